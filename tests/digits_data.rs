//! The shared digits loader gives the real optdigits data, split without overlap.
mod common;
use common::digits::{CLASSES, Digits, FEATURES};

#[test]
fn digits_split_is_complete_and_scaled() {
    let d = Digits::load(0.2, 7);
    assert_eq!(d.train_len() + d.test_len(), 1797);
    assert_eq!(d.test_len(), 359);
    assert_eq!(d.train_x.len(), d.train_len() * FEATURES);
    assert!(
        d.train_x
            .iter()
            .chain(&d.test_x)
            .all(|p| (0.0..=1.0).contains(p))
    );
    let mut counts = [0usize; CLASSES];
    d.train_y
        .iter()
        .chain(&d.test_y)
        .for_each(|&y| counts[y] += 1);
    // optdigits has between 174 and 183 images of each class.
    assert!(
        counts.iter().all(|&c| (174..=183).contains(&c)),
        "{counts:?}"
    );
}
