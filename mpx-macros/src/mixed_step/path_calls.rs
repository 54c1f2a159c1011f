//! The roles written as calls of dfdx's trait methods by path, read as the method calls they
//! are: `Optimizer::update(&mut opt, &mut model, &grads)` is `opt.update(&mut model, &grads)`,
//! `Module::forward(&model, x)` (or `ModuleMut::forward_mut`, `try_` forms, `<M as
//! Module<X>>::forward`) is `model.forward(x)`, `Backward::backward(loss)` is `loss.backward()`.
//! Only these traits' methods are read so: a path call of a function of the user's own with
//! one of those names stays as written.

use syn::visit_mut::VisitMut;

/// The traits whose role methods may be called by path, and those methods with their
/// argument counts (the receiver included).
const TRAITS: &[(&str, &[(&str, usize)])] = &[
    ("Optimizer", &[("update", 3)]),
    ("Module", &[("forward", 2), ("try_forward", 2)]),
    ("ModuleMut", &[("forward_mut", 2), ("try_forward_mut", 2)]),
    ("Backward", &[("backward", 1), ("try_backward", 1)]),
];

/// `f` with every path call of a role method rewritten as a method call.
pub(crate) fn as_method_calls(mut f: syn::ItemFn) -> syn::ItemFn {
    PathCalls.visit_item_fn_mut(&mut f);
    f
}

struct PathCalls;

impl VisitMut for PathCalls {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        syn::visit_mut::visit_expr_mut(self, e);
        if let syn::Expr::Call(call) = e
            && let Some(method) = role_method(call)
        {
            let mut args = std::mem::take(&mut call.args).into_iter();
            let Some(receiver) = args.next() else {
                return;
            };
            *e = syn::Expr::MethodCall(syn::ExprMethodCall {
                attrs: std::mem::take(&mut call.attrs),
                // in parentheses: `&mut opt` as a receiver
                receiver: Box::new(syn::Expr::Paren(syn::ExprParen {
                    attrs: Vec::new(),
                    paren_token: call.paren_token,
                    expr: Box::new(receiver),
                })),
                dot_token: syn::Token![.](method.span()),
                method,
                turbofish: None,
                paren_token: call.paren_token,
                args: args.collect(),
            });
        }
    }
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

/// The method of a path call `Trait::method(receiver, ..)` (or `<T as Trait<..>>::method`) of
/// one of [`TRAITS`], with the call's argument count.
fn role_method(call: &syn::ExprCall) -> Option<syn::Ident> {
    let syn::Expr::Path(p) = &*call.func else {
        return None;
    };
    let segments: Vec<&syn::PathSegment> = p.path.segments.iter().collect();
    let method = segments.last()?;
    // the trait: the segment before the method, or the `as` of a qualified path
    let trait_name = match &p.qself {
        Some(q) if q.position > 0 => segments.get(q.position - 1)?,
        Some(_) => return None,
        None => segments.get(segments.len().checked_sub(2)?)?,
    };
    let (_, methods) = TRAITS.iter().find(|(t, _)| trait_name.ident == t)?;
    methods
        .iter()
        .any(|(m, n)| method.ident == m && call.args.len() == *n && method.arguments.is_none())
        .then(|| method.ident.clone())
}

#[cfg(test)]
mod tests {
    use quote::{ToTokens, quote};

    fn rewritten(body: &proc_macro2::TokenStream) -> String {
        let f: syn::ItemFn = syn::parse2(quote!(fn step() { #body })).unwrap();
        super::as_method_calls(f)
            .block
            .to_token_stream()
            .to_string()
            .replace(' ', "")
    }

    #[test]
    fn the_roles_called_by_path_become_method_calls() {
        assert_eq!(
            rewritten(&quote!(
                let y = Module::forward(&model, x.traced(g));
                let y = dfdx::nn::ModuleMut::try_forward_mut(&mut model.l1, y)?;
                let y = <Net as Module<X>>::forward(&model, y);
                let g = Backward::backward(loss);
                dfdx::optim::Optimizer::update(&mut opt, &mut model, &g).unwrap();
            )),
            "{let y = (&model).forward(x.traced(g)); \
              let y = (&mut model.l1).try_forward_mut(y)?; \
              let y = (&model).forward(y); \
              let g = (loss).backward(); \
              (&mut opt).update(&mut model, &g).unwrap();}"
                .replace(' ', "")
        );
    }

    #[test]
    fn other_path_calls_stay_as_written() {
        for body in [
            quote!(Helper::forward(&model, x);),
            quote!(forward(&model, x);),
            quote!(Optimizer::update(&mut opt, &g);),
            quote!(Module::forward::<X>(&model, x);),
            quote!(<Net>::forward(&model, x);),
        ] {
            let want = quote!({ #body }).to_string().replace(' ', "");
            assert_eq!(rewritten(&body), want);
        }
    }
}
