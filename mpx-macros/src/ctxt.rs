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
    let mut out = err.into_compile_error();
    out.extend(item);
    out
}

/// Parses `key = value` attribute arguments with `syn::meta::parser`: `on_key` handles the keys
/// it knows and returns `Ok(false)` for any other, which is recorded as "unknown argument,
/// expected one of `valid`" with its value skipped; parsing goes on after every mistake, so all of
/// them are reported at once.
pub(crate) fn parse_keyed(
    args: TokenStream,
    cx: &mut Ctxt,
    valid: &str,
    on_key: impl FnMut(&str, &syn::meta::ParseNestedMeta<'_>, &mut Ctxt) -> syn::Result<bool>,
) {
    use syn::parse::Parser;
    let expected = format!("one of {valid}");
    let res = syn::meta::parser(keyed(cx, "argument", &expected, on_key)).parse2(args);
    if let Err(err) = res {
        cx.push(err);
    }
}

/// [`parse_keyed`] for a derive: the arguments of every `#[name(..)]` attribute in `attrs` (the
/// container's or a field's), an unknown key recorded as "unknown `what` `key`; expected
/// `expected`".
pub(crate) fn parse_attrs(
    attrs: &[syn::Attribute],
    name: &str,
    cx: &mut Ctxt,
    (what, expected): (&str, &str),
    mut on_key: impl FnMut(&str, &syn::meta::ParseNestedMeta<'_>, &mut Ctxt) -> syn::Result<bool>,
) {
    for attr in attrs.iter().filter(|a| a.path().is_ident(name)) {
        if let Err(err) = attr.parse_nested_meta(keyed(cx, what, expected, &mut on_key)) {
            cx.push(err);
        }
    }
}

/// The handler of one argument for [`parse_keyed`] and [`parse_attrs`].
fn keyed<'a>(
    cx: &'a mut Ctxt,
    what: &'a str,
    expected: &'a str,
    mut on_key: impl FnMut(&str, &syn::meta::ParseNestedMeta<'_>, &mut Ctxt) -> syn::Result<bool> + 'a,
) -> impl FnMut(syn::meta::ParseNestedMeta<'_>) -> syn::Result<()> + 'a {
    move |meta| {
        let key = key_of(&meta.path);
        if !on_key(&key, &meta, cx)? {
            cx.error_spanned(
                &meta.path,
                format!("unknown {what} `{key}`; expected {expected}"),
            );
            skip_value(meta.input)?;
        }
        Ok(())
    }
}

/// Stores `value` in `slot`, or records "duplicate argument" when it is already set.
pub(crate) fn set_once<T>(
    cx: &mut Ctxt,
    path: &syn::Path,
    slot: &mut Option<T>,
    value: T,
    name: &str,
) {
    if slot.is_some() {
        cx.error_spanned(path, format!("duplicate argument `{name}`"));
    } else {
        *slot = Some(value);
    }
}

/// Parses the value of `key = value` as a `T` into `slot`, once (see [`set_once`]); `Ok(true)`,
/// so a [`parse_keyed`] handler can return it for a known key.
pub(crate) fn set_parsed<T: syn::parse::Parse>(
    meta: &syn::meta::ParseNestedMeta<'_>,
    cx: &mut Ctxt,
    slot: &mut Option<T>,
    name: &str,
) -> syn::Result<bool> {
    let value: T = meta.value()?.parse()?;
    set_once(cx, &meta.path, slot, value, name);
    Ok(true)
}

/// Parses `crate = "path"` into `slot`, once; `Ok(true)`, as [`set_parsed`].
pub(crate) fn set_crate(
    meta: &syn::meta::ParseNestedMeta<'_>,
    cx: &mut Ctxt,
    slot: &mut Option<syn::Path>,
) -> syn::Result<bool> {
    let path = crate_path(meta)?;
    set_once(cx, &meta.path, slot, path, "crate");
    Ok(true)
}

/// Parses a list of names (`key = x` or `key = (x, y)`, see [`name_list`]) into `slot`, once;
/// `Ok(true)`, as [`set_parsed`].
pub(crate) fn set_names(
    meta: &syn::meta::ParseNestedMeta<'_>,
    cx: &mut Ctxt,
    slot: &mut Option<Vec<syn::Ident>>,
    name: &str,
    usage: &str,
) -> syn::Result<bool> {
    let value: syn::Expr = meta.value()?.parse()?;
    let names = name_list(&value, usage)?;
    set_once(cx, &meta.path, slot, names, name);
    Ok(true)
}

/// `x` or `(x, y, ..)`: a list of plain names (an argument's value such as `inputs = (x, y)`);
/// anything else is an error whose message is `usage`.
pub(crate) fn name_list(e: &syn::Expr, usage: &str) -> syn::Result<Vec<syn::Ident>> {
    let one = |e: &syn::Expr| match e {
        syn::Expr::Path(p) if p.qself.is_none() => p
            .path
            .get_ident()
            .cloned()
            .ok_or_else(|| syn::Error::new_spanned(e, usage)),
        other => Err(syn::Error::new_spanned(other, usage)),
    };
    match e {
        syn::Expr::Tuple(t) => t.elems.iter().map(one).collect(),
        syn::Expr::Paren(p) => Ok(vec![one(&p.expr)?]),
        other => Ok(vec![one(other)?]),
    }
}

/// Records an error for each kind of function `#[<attr>]` cannot rewrite: a `const fn` (with
/// `const_why`), an `async fn` (with `async_fix`), an `extern` one, a variadic one.
pub(crate) fn plain_fn_only(
    sig: &syn::Signature,
    attr: &str,
    const_why: &str,
    async_fix: &str,
    cx: &mut Ctxt,
) {
    let kinds = [
        (
            sig.constness.as_ref().map(ToTokens::to_token_stream),
            format!("a `const fn`: {const_why}"),
        ),
        (
            sig.asyncness.as_ref().map(ToTokens::to_token_stream),
            format!("an `async fn`; {async_fix}"),
        ),
        (
            sig.abi.as_ref().map(ToTokens::to_token_stream),
            "an `extern` function; remove the ABI".to_owned(),
        ),
        (
            sig.variadic.as_ref().map(ToTokens::to_token_stream),
            "a variadic function".to_owned(),
        ),
    ];
    for (tokens, what) in kinds {
        if let Some(tokens) = tokens {
            cx.error_spanned(tokens, format!("`#[{attr}]` cannot rewrite {what}"));
        }
    }
}

/// The end of an attribute's expansion: the errors recorded in `cx` followed by the user's item
/// unchanged, or, when there are none, the expansion `out` makes.
pub(crate) fn finish(
    cx: Ctxt,
    item: TokenStream,
    attr: &str,
    out: impl FnOnce() -> Option<TokenStream>,
) -> TokenStream {
    match cx.check().map(|()| out()) {
        Ok(Some(expanded)) => expanded,
        Err(err) => with_errors(item, err),
        // Unreachable in practice: a missing expansion always comes with a recorded error.
        Ok(None) => with_errors(
            item,
            syn::Error::new(
                proc_macro2::Span::call_site(),
                format!("`#[{attr}]` could not rewrite this item"),
            ),
        ),
    }
}

/// Skips an unknown argument's value (up to the next top-level comma).
pub(crate) fn skip_value(input: syn::parse::ParseStream<'_>) -> syn::Result<()> {
    while !input.is_empty() && !input.peek(syn::Token![,]) {
        input.parse::<proc_macro2::TokenTree>()?;
    }
    Ok(())
}

/// The value of `crate = "path"`: the facade's path, written as a string literal (serde's form).
/// It must be a plain path (`::my_crate::mpx`): generic arguments are refused here, at the
/// literal, rather than turned into code that does not parse.
pub(crate) fn crate_path(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<syn::Path> {
    let lit: syn::LitStr = meta.value()?.parse()?;
    let path: syn::Path = lit.parse()?;
    if path.segments.iter().any(|s| !s.arguments.is_none()) {
        return Err(syn::Error::new(
            lit.span(),
            format!(
                "`crate = {:?}`: expected the plain path mpx is reachable at (such as `\"::my_crate::mpx\"`), without generic arguments",
                lit.value()
            ),
        ));
    }
    Ok(path)
}

/// The pipeline of every function attribute here (`attr`: its name, and what it applies to for
/// the error on any other item): parse the arguments, read the item as a function, `check` it
/// (recording every error found in the context), and `expand` the plan only when no error was
/// recorded; otherwise the errors followed by the user's item unchanged.
pub(crate) fn expand_fn<A, P>(
    attr: (&str, &str),
    (args, item): (TokenStream, TokenStream),
    parse_args: impl FnOnce(TokenStream, &mut Ctxt) -> A,
    check: impl FnOnce(&A, Option<syn::ItemFn>, &mut Ctxt) -> Option<P>,
    expand: impl FnOnce(&A, P) -> TokenStream,
) -> TokenStream {
    let (name, applies_to) = attr;
    let mut cx = Ctxt::default();
    let parsed = parse_args(args, &mut cx);
    let f = item_fn(&item, &mut cx, name, applies_to);
    let plan = check(&parsed, f, &mut cx);
    finish(cx, item, name, || Some(expand(&parsed, plan?)))
}

/// The annotated item as a function, or an error (`what` says what the attribute applies to)
/// recorded at the item's head.
pub(crate) fn item_fn(
    item: &TokenStream,
    cx: &mut Ctxt,
    attr: &str,
    what: &str,
) -> Option<syn::ItemFn> {
    match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Fn(f)) => Some(f),
        Ok(other) => {
            cx.error_spanned(item_head(&other), format!("`#[{attr}]` applies to {what}"));
            None
        }
        Err(err) => {
            cx.push(syn::Error::new(
                err.span(),
                format!("`#[{attr}]` applies to {what} ({err})"),
            ));
            None
        }
    }
}

/// The tokens an item error points at: the item up to its name (not the whole body).
fn item_head(item: &syn::Item) -> TokenStream {
    fn head(keyword: &impl ToTokens, name: &syn::Ident) -> TokenStream {
        quote::quote!(#keyword #name)
    }
    match item {
        syn::Item::Struct(s) => head(&s.struct_token, &s.ident),
        syn::Item::Enum(e) => head(&e.enum_token, &e.ident),
        syn::Item::Impl(i) => i.impl_token.to_token_stream(),
        syn::Item::Trait(t) => head(&t.trait_token, &t.ident),
        syn::Item::Mod(m) => head(&m.mod_token, &m.ident),
        syn::Item::Const(c) => head(&c.const_token, &c.ident),
        syn::Item::Static(s) => head(&s.static_token, &s.ident),
        other => other.to_token_stream(),
    }
}

/// An argument key as written: the identifier, or the whole path without spaces (`a::b`) so the
/// "unknown argument" message quotes what the user wrote.
pub(crate) fn key_of(path: &syn::Path) -> String {
    path.get_ident().map_or_else(
        || quote::quote!(#path).to_string().replace(' ', ""),
        ToString::to_string,
    )
}

/// The path generated code names the runtime by: `::mpx::__private::mpx_runtime`, or
/// `<crate>::__private::mpx_runtime` when `crate = "path"` overrides the facade's path.
pub(crate) fn runtime_path(krate: Option<&syn::Path>) -> TokenStream {
    krate.map_or_else(
        || quote::quote!(::mpx::__private::mpx_runtime),
        |path| quote::quote!(#path::__private::mpx_runtime),
    )
}

/// Test helpers: read the messages of the `compile_error!`s in an expansion.
#[cfg(test)]
pub(crate) mod testing {
    use proc_macro2::TokenStream;

    /// The messages of every `compile_error!` in `out`, in order.
    pub(crate) fn messages(out: &TokenStream) -> Vec<String> {
        let file: syn::File = syn::parse2(out.clone()).expect("expansion parses as items");
        file.items
            .iter()
            .filter_map(|item| match item {
                syn::Item::Macro(m)
                    if m.mac
                        .path
                        .segments
                        .last()
                        .is_some_and(|s| s.ident == "compile_error") =>
                {
                    Some(
                        m.mac
                            .parse_body::<syn::LitStr>()
                            .expect("a string literal")
                            .value(),
                    )
                }
                _ => None,
            })
            .collect()
    }

    /// The items of `out` other than `compile_error!`s.
    pub(crate) fn items(out: &TokenStream) -> Vec<syn::Item> {
        let file: syn::File = syn::parse2(out.clone()).expect("expansion parses as items");
        file.items
            .into_iter()
            .filter(|item| !matches!(item, syn::Item::Macro(m) if m.mac.path.segments.last().is_some_and(|s| s.ident == "compile_error")))
            .collect()
    }
}
