//! `#[full_precision]`: parse ([`ast`]) -> validate ([`valid`]) -> expand ([`expand`]).
//!
//! ```text
//! #[full_precision]
//! fn layer_norm<H: Precision>(x: Tensor<S, H::Elem, Cpu, T>) -> Tensor<S, H::Elem, Cpu, T> { body }
//! // becomes
//! fn layer_norm<H: Precision>(__mpx_x0: Tensor<S, H::Elem, Cpu, T>) -> Tensor<S, H::Elem, Cpu, T> {
//!     ::mpx::__private::mpx_runtime::region::FullPrecision::<H>::run(__mpx_x0, |x| { body })
//! }
//! ```

pub(crate) mod ast;
pub(crate) mod ctxt;
mod expand;
mod valid;

use proc_macro2::TokenStream;

use ctxt::{Ctxt, with_errors};

/// Entry point: the expanded function, or the errors followed by the user's item unchanged.
pub fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut cx = Ctxt::default();
    let parsed_args = ast::parse_args(args, &mut cx);
    let f = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Fn(f)) => Some(f),
        Ok(other) => {
            cx.error_spanned(
                item_head(&other),
                "`#[full_precision]` applies to a function or a method with a body",
            );
            None
        }
        Err(err) => {
            cx.push(syn::Error::new(
                err.span(),
                format!(
                    "`#[full_precision]` applies to a function or a method with a body ({err})"
                ),
            ));
            None
        }
    };
    let plan = f
        .as_ref()
        .and_then(|f| valid::check(&parsed_args, f, &mut cx));
    match (cx.check(), f, plan) {
        (Ok(()), Some(f), Some(plan)) => expand::expand(&parsed_args, plan, f),
        (Err(err), _, _) => with_errors(item, err),
        // Unreachable in practice: a missing plan always comes with a recorded error.
        _ => with_errors(
            item,
            syn::Error::new(
                proc_macro2::Span::call_site(),
                "`#[full_precision]` could not rewrite this item",
            ),
        ),
    }
}

/// The tokens an item error points at: the item up to its name (not the whole body).
pub(crate) fn item_head(item: &syn::Item) -> TokenStream {
    use quote::{ToTokens, quote};
    match item {
        syn::Item::Struct(s) => {
            let (k, i) = (&s.struct_token, &s.ident);
            quote!(#k #i)
        }
        syn::Item::Enum(e) => {
            let (k, i) = (&e.enum_token, &e.ident);
            quote!(#k #i)
        }
        syn::Item::Impl(i) => i.impl_token.to_token_stream(),
        syn::Item::Trait(t) => {
            let (k, i) = (&t.trait_token, &t.ident);
            quote!(#k #i)
        }
        syn::Item::Mod(m) => {
            let (k, i) = (&m.mod_token, &m.ident);
            quote!(#k #i)
        }
        syn::Item::Const(c) => {
            let (k, i) = (&c.const_token, &c.ident);
            quote!(#k #i)
        }
        syn::Item::Static(s) => {
            let (k, i) = (&s.static_token, &s.ident);
            quote!(#k #i)
        }
        other => other.to_token_stream(),
    }
}
