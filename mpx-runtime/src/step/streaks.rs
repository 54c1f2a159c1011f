//! Skips in a row of each update: what tells a master that never trains apart from the others
//! of its step. A GAN's generator whose gradients overflow at every iteration, at a static loss
//! scale, is skipped forever while its discriminator trains; counted over the scaler's updates
//! alone, each applied update of the discriminator would start the count over, and the run would
//! go on training nothing in the generator without a word.
//!
//! An update is known by its site (the place in the code that runs it, see
//! [`iteration`](super::iteration)) and the address of the master it names: the model of a
//! `#[mixed_step]` (or a part of it) lies at one place from one step to the next, and each model of
//! an ensemble updated in a loop at one site has its own. A streak ends at an applied update; a
//! master that moved, or a new one at an old address, starts a streak of its own or continues one
//! that its skips alone could have made, so a count is never more than skips of what lies there.
//! The scaler keeps its own count of skips in a row too, across all updates: that one still
//! stops a lone master whose address changes from one step to the next.

use super::iteration::Site;

/// Most streaks kept: a step whose masters move every iteration and are always skipped would
/// otherwise add one each time (the oldest is dropped first).
const MAX_STREAKS: usize = 1024;

/// One update's skips in a row.
#[derive(Debug)]
struct Streak {
    site: Site,
    master: usize,
    skips: u64,
    /// Of them, those in a row whose backward pass ran at the scale of the one before: the scale
    /// did not move in between.
    stuck: u64,
    /// The scale the last skipped backward pass ran at.
    scale: f32,
}

/// The streaks of the updates that are being skipped now.
#[derive(Debug, Default)]
pub(crate) struct Streaks(Vec<Streak>);

impl Streaks {
    /// The update of `master` at `site` was applied: its streak is over.
    pub(crate) fn applied(&mut self, site: Site, master: usize) {
        self.0.retain(|s| !(s.site == site && s.master == master));
    }

    /// The update of `master` at `site`, whose backward pass ran at loss scale `scale`, was
    /// skipped: returns its skips in a row and, of them, those in a row at a scale that did not
    /// move.
    pub(crate) fn skipped(&mut self, site: Site, master: usize, scale: f32) -> (u64, u64) {
        let found = self
            .0
            .iter()
            .position(|s| s.site == site && s.master == master);
        let i = found.unwrap_or_else(|| {
            if self.0.len() == MAX_STREAKS {
                self.0.remove(0);
            }
            self.0.push(Streak {
                site,
                master,
                skips: 0,
                stuck: 0,
                scale: f32::INFINITY,
            });
            self.0.len() - 1
        });
        let s = &mut self.0[i];
        s.skips = s.skips.saturating_add(1);
        // a scale that changed between two skips (backed off, or grew meanwhile) is not stuck
        s.stuck = if scale == s.scale {
            s.stuck.saturating_add(1)
        } else {
            1
        };
        s.scale = scale;
        (s.skips, s.stuck)
    }

    /// Forgets every streak (a restored checkpoint starts them over).
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::Location;

    #[track_caller]
    fn site() -> Site {
        Site::Call(Location::caller())
    }

    #[test]
    fn each_update_counts_its_own_skips_and_an_applied_one_ends_only_its_own() {
        let mut st = Streaks::default();
        let (g, d) = (site(), site());
        for k in 1..=3 {
            // the generator skipped at a static scale, the discriminator applied
            assert_eq!(st.skipped(g, 1, 1024.0), (k, k));
            st.applied(d, 2);
        }
        // the same site with another master (an ensemble in a loop) has a streak of its own
        assert_eq!(st.skipped(g, 3, 1024.0), (1, 1));
        st.applied(g, 1);
        assert_eq!(st.skipped(g, 1, 1024.0), (1, 1));
        assert_eq!(st.skipped(g, 3, 1024.0), (2, 2));
    }

    #[test]
    fn a_scale_that_moves_between_skips_is_not_stuck() {
        let mut st = Streaks::default();
        let s = site();
        assert_eq!(st.skipped(s, 1, 1024.0), (1, 1));
        assert_eq!(st.skipped(s, 1, 512.0), (2, 1));
        assert_eq!(st.skipped(s, 1, 512.0), (3, 2));
        assert_eq!(st.skipped(s, 1, 256.0), (4, 1));
        // grown meanwhile (the step's other updates applied for a growth period)
        assert_eq!(st.skipped(s, 1, 512.0), (5, 1));
    }

    #[test]
    fn the_streaks_kept_are_bounded() {
        let mut st = Streaks::default();
        let s = site();
        for m in 0..MAX_STREAKS + 10 {
            st.skipped(s, m, 1.0);
        }
        assert_eq!(st.0.len(), MAX_STREAKS);
        // the oldest went first
        assert_eq!(st.skipped(s, 0, 1.0), (1, 1));
        assert_eq!(st.skipped(s, MAX_STREAKS + 9, 1.0), (2, 2));
    }
}
