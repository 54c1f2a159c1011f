//! `#[half_forward]` on a module's `Module` (or `ModuleMut`) impl, or on an inherent impl holding
//! the helpers its forward code calls (`self.encode(x)`): the impl as written, and the same impl
//! for the module's working struct in each precision, with the element type and the device made
//! concrete.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote};
use syn::visit_mut::VisitMut;

use super::concrete::Concrete;
use super::{PRECISIONS, param_bounded_by, working_name};
use crate::ctxt::{Ctxt, crate_path, runtime_path, set_once, with_errors};

/// Entry point: the impl and its working-struct twins, or the errors followed by the impl.
pub(crate) fn expand(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut cx = Ctxt::default();
    let mut krate = None;
    crate::ctxt::parse_keyed(args, &mut cx, "`crate`", |key, meta, cx| {
        if key != "crate" {
            return Ok(false);
        }
        let v = crate_path(meta)?;
        set_once(cx, &meta.path, &mut krate, v, "crate");
        Ok(true)
    });
    let imp: syn::ItemImpl = if let Ok(i) = syn::parse2(item.clone()) {
        i
    } else {
        cx.error_spanned(&item, APPLIES_TO);
        return finish(cx, item, &TokenStream::new());
    };
    // a `Module` impl, or an inherent one (the forward code's helpers); any other trait's impl
    // has a twin of its own or none (the derive writes the working struct's `TensorCollection`)
    let is_module = match &imp.trait_ {
        None => true,
        Some((path, _)) => path
            .segments
            .last()
            .is_some_and(|s| s.ident == "Module" || s.ident == "ModuleMut"),
    };
    if let (false, Some((path, _))) = (is_module, &imp.trait_) {
        cx.error_spanned(path, APPLIES_TO);
    }
    let elem = param_bounded_by(&imp.generics, &["Dtype"]);
    let dev = param_bounded_by(&imp.generics, &["Device", "Storage"]);
    if elem.is_none() {
        cx.error_spanned(
            imp.impl_token,
            "`#[half_forward]` needs the impl written for any element type (`impl<E: Dtype, D: Device<E>, ..> Module<..> for Net<E, D>`, or `impl<E: Dtype, D: Device<E>> Net<E, D>` for helpers): its working copy runs it in f16 and bf16",
        );
    }
    let self_path = match &*imp.self_ty {
        syn::Type::Path(p) if p.qself.is_none() => Some(p.path.clone()),
        other => {
            cx.error_spanned(
                other,
                "`#[half_forward]`: the module must be a named struct",
            );
            None
        }
    };
    let (Some(elem), Some(self_path), true) = (elem, self_path, is_module) else {
        return finish(cx, item, &TokenStream::new());
    };
    let rt = runtime_path(krate.as_ref());
    // autocast's float32 list in f32 regions of the inputs' own element type, the table and the
    // rewrite `#[autocast]` uses, for the twins of 16-bit storage; the impl as written and the
    // twin of f32 storage (emulated bf16) run those operations in f32 already
    let mut regioned = imp.clone();
    crate::autocast::expand::FreeToMethod.visit_item_impl_mut(&mut regioned);
    let mut regions = crate::autocast::expand::Rewriter::with_region(
        "#[half_forward]",
        quote!(#rt::__private::ElemRegion),
        &[],
    )
    .with_scalars(vec![elem.clone()]);
    regions.visit_item_impl_mut(&mut regioned);
    for err in regions.errors {
        cx.push(err);
    }
    let mut twins = TokenStream::new();
    for (precision, stored) in PRECISIONS {
        let half_storage = stored != "f32";
        let code = if half_storage { &regioned } else { &imp };
        let precision: syn::Type = syn::parse_str(precision).expect("a type");
        let stored: syn::Type = syn::parse_str(stored).expect("a type");
        let precision = qualify(&precision, &rt);
        let stored = qualify(&stored, &rt);
        twins.extend(twin(
            code,
            &self_path,
            &elem,
            dev.as_ref(),
            (&precision, &stored, half_storage),
            &rt,
        ));
    }
    finish(cx, item, &twins)
}

/// Where the attribute goes.
const APPLIES_TO: &str = "`#[half_forward]` applies to a module's `Module` (or `ModuleMut`) impls, whose forward code it runs on the module's working copy, and to the module's inherent impls that hold the helper methods that code calls (`impl<E: Dtype, D: Device<E>> Net<E, D> { fn encode(..) }`)";

/// The item followed by `extra`, or the errors followed by the item.
fn finish(cx: Ctxt, item: TokenStream, extra: &TokenStream) -> TokenStream {
    match cx.check() {
        Ok(()) => quote!(#item #extra),
        Err(err) => with_errors(item, err),
    }
}

/// `f16`, `AMP<f16>`, `bf16`, `f32` as paths under the runtime's `precision` module (`f32`
/// as itself).
fn qualify(t: &syn::Type, rt: &TokenStream) -> syn::Type {
    struct Q<'a>(&'a TokenStream);
    impl VisitMut for Q<'_> {
        fn visit_type_mut(&mut self, t: &mut syn::Type) {
            syn::visit_mut::visit_type_mut(self, t);
            if let syn::Type::Path(p) = t
                && let Some(first) = p.path.segments.first_mut()
                && ["f16", "bf16", "AMP"].iter().any(|n| first.ident == n)
            {
                let rt = self.0;
                let seg = first.clone();
                *t = syn::parse_quote!(#rt::precision::#seg);
            }
        }
    }
    let mut t = t.clone();
    Q(rt).visit_type_mut(&mut t);
    t
}

/// The impl for `<Name>Working<.., precision>`, with `elem` as `stored` and `dev` as `Cpu`.
fn twin(
    imp: &syn::ItemImpl,
    self_path: &syn::Path,
    elem: &syn::Ident,
    dev: Option<&syn::Ident>,
    (precision, stored, half_storage): (&syn::Type, &syn::Type, bool),
    rt: &TokenStream,
) -> TokenStream {
    let mut imp = imp.clone();
    imp.attrs.retain(|a| {
        a.path()
            .segments
            .last()
            .is_none_or(|s| s.ident != "half_forward")
    });
    // an inherent impl's twin holds what the forward code reaches through `self`: its methods,
    // constants and types, not its functions without a receiver (a constructor that builds the
    // master's layers would not compile for the working struct)
    if imp.trait_.is_none() {
        imp.items
            .retain(|item| !matches!(item, syn::ImplItem::Fn(f) if f.sig.receiver().is_none()));
    }
    // the element type and the device leave the impl's parameters
    let is_ed = |id: &syn::Ident| id == elem || dev.is_some_and(|d| id == d);
    bring_bounds_into_scope(&mut imp, &is_ed);
    imp.generics.params = imp
        .generics
        .params
        .into_iter()
        .filter(|p| !matches!(p, syn::GenericParam::Type(t) if is_ed(&t.ident)))
        .collect();
    if let Some(w) = &mut imp.generics.where_clause {
        w.predicates = std::mem::take(&mut w.predicates)
            .into_iter()
            .filter(|p| {
                !matches!(p, syn::WherePredicate::Type(pt)
                    if matches!(&pt.bounded_ty, syn::Type::Path(tp) if tp.path.get_ident().is_some_and(&is_ed)))
            })
            .collect();
    }
    // the working struct, with the module's other arguments
    let last = self_path.segments.last().expect("a path has a segment");
    let working = working_name(&last.ident);
    let mut args: Vec<syn::GenericArgument> = match &last.arguments {
        syn::PathArguments::AngleBracketed(a) => a
            .args
            .iter()
            .filter(|g| {
                !matches!(g, syn::GenericArgument::Type(syn::Type::Path(tp))
                    if tp.path.get_ident().is_some_and(&is_ed))
            })
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    args.push(syn::GenericArgument::Type(precision.clone()));
    let mut prefix = self_path.clone();
    prefix.segments.pop();
    let working_path = if prefix.segments.is_empty() {
        quote!(#working<#(#args),*>)
    } else {
        let prefix = prefix.segments.iter();
        quote!(#(#prefix::)* #working<#(#args),*>)
    };
    *imp.self_ty = syn::parse_quote!(#working_path);
    Concrete {
        elem,
        dev,
        stored,
        rt,
        consts: 0,
        half_storage,
    }
    .visit_item_impl_mut(&mut imp);
    quote!(#imp)
}

/// The traits the element type and the device are bounded by (`E: Dtype + num_traits::Float`),
/// imported at the start of each function of the twin: the generic code calls their methods
/// through the bounds (`scale.sqrt()` on an `E`), which the twin drops with the parameters, so
/// on the concrete types the methods resolve only with the traits in scope.
fn bring_bounds_into_scope(imp: &mut syn::ItemImpl, is_ed: &dyn Fn(&syn::Ident) -> bool) {
    let mut traits: Vec<syn::Path> = Vec::new();
    for (_, bounds) in crate::syntax::param_bounds(&imp.generics).filter(|(id, _)| is_ed(id)) {
        for b in bounds {
            if let syn::TypeParamBound::Trait(t) = b
                && t.maybe.is_none()
            {
                let mut path = t.path.clone();
                if let Some(last) = path.segments.last_mut() {
                    last.arguments = syn::PathArguments::None;
                }
                let text = path.to_token_stream().to_string();
                if !traits
                    .iter()
                    .any(|p| p.to_token_stream().to_string() == text)
                {
                    traits.push(path);
                }
            }
        }
    }
    if traits.is_empty() {
        return;
    }
    let uses: Vec<syn::Stmt> = traits
        .iter()
        .map(|t| syn::parse_quote!(#[allow(unused_imports)] use #t as _;))
        .collect();
    for item in &mut imp.items {
        if let syn::ImplItem::Fn(f) = item {
            f.block.stmts.splice(0..0, uses.iter().cloned());
        }
    }
}

#[cfg(test)]
mod tests {
    use proc_macro2::TokenStream;
    use quote::quote;

    /// The expansion of a `Module` impl of `Net` whose `try_forward(&self, x)` (a `2 x 3` tensor
    /// in and out) runs `body`: the impl as written and its twins, spaces removed, checked free of
    /// compile errors.
    fn twins(body: &TokenStream) -> String {
        let out = super::expand(
            quote!(),
            quote! {
                impl<E: Dtype, D: Device<E>> Module<Tensor<Rank2<2, 3>, E, D>> for Net<E, D> {
                    type Output = Tensor<Rank2<2, 3>, E, D>;
                    type Error = D::Err;
                    fn try_forward(&self, x: Tensor<Rank2<2, 3>, E, D>) -> Result<Self::Output, D::Err> {
                        #body
                    }
                }
            },
        )
        .to_string()
        .replace(' ', "");
        assert!(!out.contains("compile_error"), "{out}");
        out
    }

    /// The f16 twin's code: the tensor ops go through the dispatch, the const contexts and the
    /// parentheses do not.
    #[test]
    fn the_twin_dispatches_the_ops_and_leaves_const_contexts_alone() {
        let out = twins(&quote! {
                let n = [0u8; 2 * 3].len() + foo::<{ 4 - 1 }>();
                let y = (x.clone() + self.b.clone()).try_matmul(self.w.clone())?;
                Ok(-(y * x / 2.0) - -1.0)
        });
        // the user's impl as written, then a twin per precision
        assert!(out.contains("[0u8;2*3]"), "{out}");
        assert!(out.contains("foo::<{4-1}>"), "{out}");
        assert!(out.contains(".add_op()"), "{out}");
        assert!(out.contains(".try_matmul_op()"), "{out}");
        assert!(out.contains(".mul_op()"), "{out}");
        assert!(out.contains(".div_op()"), "{out}");
        assert!(out.contains("__mpx_a/__mpx_b"), "{out}");
        // a negation dispatches, a negative literal does not
        assert!(out.contains(".neg_op()"), "{out}");
        assert!(out.contains("-__mpx_a"), "{out}");
        assert_eq!(
            out.matches(".neg_op()").count(),
            out.matches(".div_op()").count(),
            "{out}"
        );
        assert!(!out.contains("Operands::new(1.0,())"), "{out}");
        // the operand of the product is the dispatch block itself, not a parenthesised one,
        // and each op as written follows for any other operands
        assert!(out.contains("Operands::new({use"), "{out}");
        assert!(out.contains("__mpx_a.try_matmul(__mpx_b)"), "{out}");
        assert!(out.contains("__mpx_a*__mpx_b"), "{out}");
        // `.len() + foo()` dispatches too (numbers take the operator as written at run time),
        // in the twins of 16-bit storage; the twin of f32 storage has the code as written
        let half = super::PRECISIONS
            .iter()
            .filter(|(_, stored)| *stored != "f32")
            .count();
        assert_eq!(half, 2);
        assert_eq!(out.matches(".add_op()").count(), 2 * half, "{out}");
        assert_eq!(
            out.matches("(x.clone()+self.b.clone()).try_matmul(self.w.clone())?;")
                .count(),
            1 + super::PRECISIONS.len() - half,
            "{out}"
        );
    }

    /// The float32 list's operations (the table `#[autocast]` wraps) go through f32 regions of
    /// their inputs' element type, a chain in one; the activations through mpx's layers.
    #[test]
    fn the_twin_runs_the_float32_lists_operations_in_f32() {
        let out = twins(&quote! {
                let a = x.clone().softmax::<Axis<1>>().exp();
                let b = x.clone().try_log_softmax::<Axis<1>>()?.try_ln()?;
                let c = x.tanh().sum::<Rank0, _>();
                Ok(a)
        });
        // the twins of 16-bit storage (the emulated bf16 one, f32 storage, runs them as written)
        let twins = super::PRECISIONS
            .iter()
            .filter(|(_, stored)| *stored != "f32")
            .count();
        assert_eq!(twins, 2);
        // a chain is one region, its `try_` forms and `?` inside as the plain forms
        for chain in [
            "ElemRegion::run(x.clone(),|__mpx_x0|__mpx_x0.softmax::<Axis<1>>().exp())",
            "ElemRegion::try_run(x.clone(),|__mpx_x0|__mpx_x0.log_softmax::<Axis<1>>().ln())?",
            "|__mpx_x0|__mpx_x0.sum::<Rank0,_>())",
        ] {
            assert_eq!(out.matches(chain).count(), twins, "{chain}: {out}");
        }
        // an activation in a region's input goes through the methods' dispatch (mpx's layer
        // for a half tensor), before the region
        assert_eq!(
            out.matches("ElemRegion::run({use::mpx::__private::mpx_runtime::__private::binary::{AsWrittenas_,HalfMethodsas_};let__mpx_ops=::mpx::__private::mpx_runtime::__private::binary::Operands::new(x,());match(&__mpx_ops).tanh_op()").count(),
            twins,
            "{out}"
        );
        // the impl as written is left as it is
        assert!(
            out.contains("leta=x.clone().softmax::<Axis<1>>().exp();"),
            "{out}"
        );
        assert_eq!(out.matches("ElemRegion").count(), 3 * twins, "{out}");
    }

    /// `E`'s items by the traits `E: Dtype` brings them through, anything else through the
    /// concrete type as written; `D::Err` as `Cpu`'s.
    #[test]
    fn the_element_types_items_are_reached_through_their_traits() {
        let out = twins(&quote! {
                let a = E::from_f64(0.5).unwrap() * E::ONE + E::default();
                let b = E::to_f32(&a).unwrap() + E::epsilon();
                let c: Result<(), D::Err> = Ok(());
                Ok(x)
        });
        let per_twin = |needle: &str| out.matches(needle).count() == super::PRECISIONS.len();
        for needle in [
            "__private::num_traits::FromPrimitive>::from_f64(0.5)",
            "__private::num_traits::ToPrimitive>::to_f32(&a)",
            "__private::dfdx::dtypes::Unit>::ONE",
            "letc:Result<(),<::mpx::__private::mpx_runtime::__private::dfdx::tensor::Cpuas::mpx::__private::mpx_runtime::__private::dfdx::tensor::HasErr>::Err>",
            // as written on the concrete type: `Default`'s, and a method of the user's imports
            ">::default()",
            ">::epsilon()",
        ] {
            assert!(per_twin(needle), "{needle}: {out}");
        }
    }

    /// The element type's trait bounds are in scope in the twins (a number's `sqrt` through
    /// `E: num_traits::Float`), and a number made from the element type is no region's input:
    /// its `recip` stays a method call, a tensor's goes to a region.
    #[test]
    fn a_number_of_the_element_type_keeps_its_methods() {
        let out = super::expand(
            quote!(),
            quote! {
                impl<E, D: Device<E>> Module<Tensor<Rank1<3>, E, D>> for Net<E, D>
                where
                    E: Dtype + num_traits::Float,
                {
                    type Output = Tensor<Rank1<3>, E, D>;
                    type Error = D::Err;
                    fn try_forward(&self, x: Tensor<Rank1<3>, E, D>) -> Result<Self::Output, D::Err> {
                        let s = E::from_usize(8).unwrap().sqrt().recip();
                        Ok(x.recip() * s)
                    }
                }
            },
        )
        .to_string()
        .replace(' ', "");
        assert!(!out.contains("compile_error"), "{out}");
        let twins = super::PRECISIONS.len();
        assert_eq!(
            out.matches("#[allow(unused_imports)]usenum_traits::Floatas_;")
                .count(),
            twins,
            "{out}"
        );
        assert_eq!(
            out.matches("#[allow(unused_imports)]useDtypeas_;").count(),
            twins,
            "{out}"
        );
        // the tensor's `recip` in a region (the twins of 16-bit storage), the number's not
        assert_eq!(
            out.matches("ElemRegion::run(x,|__mpx_x0|__mpx_x0.recip())")
                .count(),
            2,
            "{out}"
        );
        assert_eq!(out.matches("ElemRegion").count(), 2, "{out}");
    }

    /// `#[half_forward]` on an inherent impl (the helpers the forward code calls): the impl as
    /// written and its twin per precision on the working struct, with its methods and without
    /// its functions that take no `self` (a constructor); on another trait's impl, an error at
    /// the trait.
    #[test]
    fn an_inherent_impl_has_twins_and_another_traits_impl_is_an_error() {
        let out = super::expand(
            quote!(),
            quote! {
                impl<E: Dtype, D: Device<E>> Net<E, D> {
                    fn new(dev: &D) -> Self {
                        Self { l1: BuildModule::build(dev) }
                    }
                    fn hidden<T: Tape<E, D>>(&self, x: Tensor<Rank1<3>, E, D, T>) -> Result<Tensor<Rank1<3>, E, D, T>, D::Err> {
                        self.l1.try_forward(x)?.try_relu()
                    }
                }
            },
        )
        .to_string()
        .replace(' ', "");
        assert!(!out.contains("compile_error"), "{out}");
        assert!(out.contains("impl<E:Dtype,D:Device<E>>Net<E,D>{"), "{out}");
        assert_eq!(
            out.matches("implNetWorking<").count(),
            super::PRECISIONS.len(),
            "{out}"
        );
        assert_eq!(
            out.matches(".try_relu_op()").count(),
            super::PRECISIONS.len(),
            "{out}"
        );
        // the constructor stays with the module alone
        assert_eq!(out.matches("fnnew(").count(), 1, "{out}");
        let out = super::expand(
            quote!(),
            quote! {
                impl<E: Dtype, D: Device<E>> TensorCollection<E, D> for Net<E, D> {}
            },
        );
        let msgs = crate::ctxt::testing::messages(&out);
        assert_eq!(msgs.len(), 1, "{out}");
        assert!(
            msgs[0].contains("inherent impls that hold the helper methods"),
            "{msgs:?}"
        );
    }

    /// `(a + b).relu()`: the activation's argument loses the parentheses an argument does not
    /// need (kept, they would warn in the user's crate); the element-wise methods dispatch by
    /// type, in their plain and `try_` forms, with the method as written for anything else.
    #[test]
    fn an_activations_parenthesised_receiver_is_its_argument_without_them() {
        let out = twins(&quote! {
                let s = (2.0f32).sqrt();
                ((x.clone() + x)).try_relu()?.square()
        });
        // per twin: `relu`'s argument is the add's dispatch (the add as written in the twin of
        // f32 storage), `square`'s the relu's (and `?`)
        assert_eq!(out.matches("Operands::new({use").count(), 5, "{out}");
        assert!(out.contains("Operands::new(x.clone()+x,())"), "{out}");
        assert!(!out.contains("Operands::new(("), "{out}");
        for (dispatch, written) in [
            (".try_relu_op()", "__mpx_a.try_relu()"),
            (".square_op()", "__mpx_a.square()"),
            (".sqrt_op()", "__mpx_a.sqrt()"),
        ] {
            assert_eq!(out.matches(dispatch).count(), 3, "{dispatch}: {out}");
            assert_eq!(out.matches(written).count(), 3, "{written}: {out}");
        }
    }
}
