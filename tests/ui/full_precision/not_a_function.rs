// `#[full_precision]` on a struct: it rewrites functions only.
use mpx::full_precision;

#[full_precision]
struct Block {
    width: usize,
}

fn main() {
    let _ = Block { width: 8 }.width;
}
