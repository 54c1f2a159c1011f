// `#[autocast]` on a struct: it rewrites function bodies only (the struct is kept).
use mpx::autocast;

#[autocast]
struct Attention {
    heads: usize,
}

fn main() {
    let _ = Attention { heads: 2 }.heads;
}
