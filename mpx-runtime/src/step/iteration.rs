//! When the one loss scale is adjusted: once per iteration, as PyTorch's `scaler.update()` is
//! called once after every `scaler.step(opt)` of an iteration.
//!
//! Here each update is its master's step, and nothing names the end of an iteration, so it is
//! read off the updates themselves. An update is known by its **site**, the place in the code
//! that runs it (the `opt.update(..)` of a `#[mixed_step]`, or a call of
//! [`GradScaler::update`](super::GradScaler::update)); an iteration is over at an update when
//! - no other master has gradients waiting for their update (a backward pass reached it and its
//!   update has not run: the second model of an actor-critic step), and
//! - every site that took part in the last iteration has had its update in this one (the
//!   generator after the discriminator of a GAN);
//!
//! and a site that updates twice closes the iteration it already took part in first. A skip
//! anywhere in an iteration backs the scale off once. With one model and one update site, every
//! update is an iteration, as in jmp and mpx.

use std::panic::Location;
use std::sync::{Mutex, PoisonError, Weak};

/// Where an update runs: a call of the runtime API (its location in the source), or an update
/// `#[mixed_step]` rewrote (a static of the generated code, one per `opt.update(..)`: a
/// location there would be the attribute's, the same for every update of the step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Site {
    /// A call of [`GradScaler::update`](super::GradScaler::update) or
    /// [`update_with`](super::GradScaler::update_with).
    Call(&'static Location<'static>),
    /// An update of a `#[mixed_step]`, by the address of a static of its own.
    Step(usize),
}

use super::pending::{Cell, Pending};

/// The iteration in progress.
#[derive(Debug, Default)]
pub(crate) struct Iteration {
    /// The sites updated in this iteration.
    sites: Vec<Site>,
    /// The sites that took part in the last closed one.
    last: Vec<Site>,
    /// Whether an update of this iteration was skipped.
    found_inf: bool,
    /// Masters a backward pass reached, whose update may not have run yet.
    waiting: Vec<Weak<Mutex<Pending>>>,
}

impl Iteration {
    /// A backward pass reached the master of `cell`.
    pub(crate) fn reached(&mut self, cell: &Cell) {
        let weak = cell.downgrade();
        if !self.waiting.iter().any(|w| w.ptr_eq(&weak)) {
            self.waiting.push(weak);
        }
    }

    /// The master of `cell` had its update at `site` (`applied` or skipped); returns the scale
    /// adjustments due now, in order: `Some(finite)` for each iteration this update closes.
    pub(crate) fn updated(&mut self, cell: &Cell, site: Site, applied: bool) -> [Option<bool>; 2] {
        let mut due = [None, None];
        if self.sites.contains(&site) {
            due[0] = Some(self.close());
        }
        self.sites.push(site);
        self.found_inf |= !applied;
        let this = cell.downgrade();
        self.waiting.retain(|w| {
            !w.ptr_eq(&this)
                && w.upgrade()
                    .is_some_and(|p| p.lock().unwrap_or_else(PoisonError::into_inner).backwards > 0)
        });
        if self.waiting.is_empty() && self.last.iter().all(|s| self.sites.contains(s)) {
            due[1] = Some(self.close());
        }
        due
    }

    /// Ends the iteration: returns whether all its updates were applied.
    fn close(&mut self) -> bool {
        let finite = !std::mem::take(&mut self.found_inf);
        self.last = std::mem::take(&mut self.sites);
        finite
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn site() -> Site {
        Site::Call(Location::caller())
    }

    fn waiting(cell: &Cell) {
        cell.lock().backwards = 1;
    }

    fn done(cell: &Cell) {
        cell.lock().consumed();
    }

    /// One master's whole pass: its backward pass reaches it, then its update at `s`.
    fn pass(it: &mut Iteration, cell: &Cell, s: Site, applied: bool) -> [Option<bool>; 2] {
        waiting(cell);
        it.reached(cell);
        done(cell);
        it.updated(cell, s, applied)
    }

    #[test]
    fn one_site_closes_at_every_update() {
        let (mut it, cell, s) = (Iteration::default(), Cell::default(), site());
        for applied in [true, false, true] {
            assert_eq!(pass(&mut it, &cell, s, applied), [None, Some(applied)]);
        }
    }

    #[test]
    fn two_masters_of_one_step_close_once_after_both() {
        let mut it = Iteration::default();
        let (actor, critic) = (Cell::default(), Cell::default());
        let (sa, sc) = (site(), site());
        for _ in 0..3 {
            for c in [&actor, &critic] {
                waiting(c);
                it.reached(c);
            }
            done(&actor);
            assert_eq!(it.updated(&actor, sa, false), [None, None]);
            done(&critic);
            // the actor's skip backs the scale off once, when the iteration is over
            assert_eq!(it.updated(&critic, sc, true), [None, Some(false)]);
        }
    }

    #[test]
    fn two_sites_in_turn_close_once_per_pair_after_the_first() {
        let mut it = Iteration::default();
        let (d, g) = (Cell::default(), Cell::default());
        let (sd, sg) = (site(), site());
        assert_eq!(pass(&mut it, &d, sd, true), [None, Some(true)]);
        // the discriminator took part in the last iteration and has not updated in this one
        assert_eq!(pass(&mut it, &g, sg, true), [None, None]);
        for _ in 0..3 {
            assert_eq!(pass(&mut it, &d, sd, true), [None, Some(true)]);
            assert_eq!(pass(&mut it, &g, sg, true), [None, None]);
        }
    }

    #[test]
    fn a_site_that_updates_twice_closes_its_iteration_first() {
        let mut it = Iteration::default();
        let (a, b) = (Cell::default(), Cell::default());
        let s = site();
        waiting(&b);
        it.reached(&b);
        // `b` waits: the update of `a` cannot close the iteration
        assert_eq!(it.updated(&a, s, false), [None, None]);
        // the same site again: the first iteration is over (with its skip)
        assert_eq!(it.updated(&a, s, true)[0], Some(false));
    }
}
