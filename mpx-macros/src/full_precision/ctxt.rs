//! Error collection (serde's `Ctxt` habit): every independent mistake is recorded with its span
//! and all of them are reported together.

use proc_macro2::TokenStream;
use quote::ToTokens;

/// Collects spanned errors while parsing and validating one macro invocation.
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    /// Records an error spanning `tokens`.
    pub(crate) fn error_spanned(&mut self, tokens: impl ToTokens, msg: impl std::fmt::Display) {
        self.errors
            .push(syn::Error::new_spanned(tokens.into_token_stream(), msg));
    }

    /// Records an already built error.
    pub(crate) fn push(&mut self, err: syn::Error) {
        self.errors.push(err);
    }

    /// `Ok` when nothing was recorded; otherwise all errors combined into one.
    pub(crate) fn check(self) -> syn::Result<()> {
        let mut iter = self.errors.into_iter();
        match iter.next() {
            None => Ok(()),
            Some(mut first) => {
                first.extend(iter);
                Err(first)
            }
        }
    }
}

/// The user's item unchanged, preceded by the errors (tokio's `token_stream_with_error`): the
/// item keeps compiling so the IDE and the rest of the crate still see it.
pub(crate) fn with_errors(item: TokenStream, err: syn::Error) -> TokenStream {
    let mut out = err.to_compile_error();
    out.extend(item);
    out
}

/// The path generated code names the runtime by: `::mpx::__private::mpx_runtime`, or
/// `<crate>::__private::mpx_runtime` when `crate = "path"` overrides the facade's path.
pub(crate) fn runtime_path(krate: Option<&syn::Path>) -> TokenStream {
    match krate {
        Some(path) => quote::quote!(#path::__private::mpx_runtime),
        None => quote::quote!(::mpx::__private::mpx_runtime),
    }
}
