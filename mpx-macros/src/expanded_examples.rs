//! The hand-written `examples/*-expanded.rs` files are what the macros generate for the examples
//! they expand (pin-project's habit): each annotated function of `examples/<name>.rs` is expanded
//! here and compared, token for token, with the function of the same name in
//! `examples/<name>-expanded.rs`. A change to a macro's output fails here until the expanded file
//! is regenerated.

use proc_macro2::TokenStream;
use quote::quote;

/// An annotated function of an example: its name, its attribute's arguments and the function
/// without that attribute.
struct Annotated {
    name: String,
    args: Option<TokenStream>,
    item: syn::ItemFn,
}

/// The functions of `examples/<file>.rs` (methods of `impl` blocks included) with the arguments of
/// their `#[<attr>]`, if annotated; doc comments and `#[rustfmt::skip]` removed.
fn example_fns(file: &str, attr: &str) -> Vec<Annotated> {
    let path = format!("{}/../examples/{file}.rs", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let parsed: syn::File =
        syn::parse_file(&text).unwrap_or_else(|e| panic!("{path} does not parse: {e}"));
    let mut out = Vec::new();
    let mut take = |attrs: &[syn::Attribute], mut item: syn::ItemFn| {
        let args = attrs
            .iter()
            .find(|a| a.path().is_ident(attr))
            .map(|a| match &a.meta {
                syn::Meta::List(l) => l.tokens.clone(),
                _ => TokenStream::new(),
            });
        item.attrs.retain(|a| {
            !a.path().is_ident(attr)
                && !a.path().is_ident("doc")
                && a.path()
                    .segments
                    .first()
                    .is_none_or(|s| s.ident != "rustfmt")
        });
        let name = item.sig.ident.to_string();
        out.push(Annotated { name, args, item });
    };
    for item in parsed.items {
        match item {
            syn::Item::Fn(f) => take(&f.attrs.clone(), f),
            syn::Item::Impl(i) => {
                for it in i.items {
                    if let syn::ImplItem::Fn(m) = it {
                        let f: syn::ItemFn =
                            syn::parse2(quote!(#m)).expect("a method parses as a fn");
                        take(&m.attrs, f);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Expands every function of `examples/<example>.rs` annotated with `#[<attr>]` with `expand`
/// and compares it with `examples/<example>-expanded.rs`; returns how many were compared.
fn check(example: &str, attr: &str, expand: fn(TokenStream, TokenStream) -> TokenStream) -> usize {
    let squeeze = |s: String| s.replace([' ', '\n'], "");
    let expanded_file = format!("{example}-expanded");
    let expanded = example_fns(&expanded_file, attr);
    let mut checked = 0;
    for f in example_fns(example, attr) {
        let Some(args) = f.args else { continue };
        let item = &f.item;
        let out = expand(args, quote!(#item)).to_string();
        assert!(!out.contains("compile_error"), "{out}");
        let by_hand = expanded.iter().find(|e| e.name == f.name).map_or_else(
            || panic!("`{}` is missing from {expanded_file}.rs", f.name),
            |e| {
                let item = &e.item;
                quote!(#item).to_string()
            },
        );
        assert_eq!(
            squeeze(out),
            squeeze(by_hand),
            "examples/{expanded_file}.rs no longer matches what #[{attr}] generates for `{}`",
            f.name
        );
        checked += 1;
    }
    checked
}

#[test]
fn autocast_expanded_is_what_the_macro_generates() {
    let checked = check("autocast", "autocast", crate::autocast::expand);
    assert_eq!(checked, 2, "the example annotates `try_forward` and `loss`");
}

#[test]
fn mixed_step_expanded_is_what_the_macro_generates() {
    let checked = check("mixed_step", "mixed_step", crate::mixed_step::expand);
    assert_eq!(checked, 1, "the example annotates `train_epoch`");
}
