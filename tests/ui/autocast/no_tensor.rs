// No tensor anywhere: the iterator `sum` is left alone, so nothing would run in f32.
use mpx::autocast;
use mpx::precision::Precision;

#[autocast]
fn mean_length<H: Precision>(lengths: &[usize]) -> f32 {
    lengths.iter().sum::<usize>() as f32 / lengths.len() as f32
}

fn main() {}
