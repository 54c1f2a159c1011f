//! (Being written: parse -> validate -> expand.)

use proc_macro2::TokenStream;

/// Placeholder until the macro lands: reports that it is not available yet and keeps the item.
pub fn expand(_args: TokenStream, _args_and_item: TokenStream) -> TokenStream {
    let mut out = syn::Error::new(
        proc_macro2::Span::call_site(),
        "this mpx macro is not available yet",
    )
    .to_compile_error();
    out.extend(_args_and_item);
    out
}
