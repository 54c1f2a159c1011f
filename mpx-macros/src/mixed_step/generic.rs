//! Steps generic over their model (dfdx's `generic-train-loop.rs`): a mixed step trains an f32
//! master on the CPU, so a type parameter bounded by `Dtype` becomes `f32` and one bounded by
//! `Device<..>` becomes `Cpu`; and the bounds the runtime needs on the model's half working copy
//! are added, read off the model's own `Module<X>` / `ModuleMut<X>` bound.

use proc_macro2::TokenStream;
use quote::quote;
use syn::visit_mut::VisitMut;

/// The last segment's name of a bound, if it is a trait path.
fn bound_name(b: &syn::TypeParamBound) -> Option<(String, &syn::PathSegment)> {
    match b {
        syn::TypeParamBound::Trait(t) => t.path.segments.last().map(|s| (s.ident.to_string(), s)),
        _ => None,
    }
}

/// Every bound on type parameter `name`, inline or in the where clause.
fn bounds_of<'a>(g: &'a syn::Generics, name: &str) -> Vec<&'a syn::TypeParamBound> {
    let mut out: Vec<&syn::TypeParamBound> = Vec::new();
    for p in &g.params {
        if let syn::GenericParam::Type(t) = p
            && t.ident == name
        {
            out.extend(t.bounds.iter());
        }
    }
    if let Some(w) = &g.where_clause {
        for pred in &w.predicates {
            if let syn::WherePredicate::Type(pt) = pred
                && matches!(&pt.bounded_ty, syn::Type::Path(p) if p.path.is_ident(name))
            {
                out.extend(pt.bounds.iter());
            }
        }
    }
    out
}

/// Replaces the dtype and device parameters by `f32` and `Cpu`.
struct Specialise {
    dtypes: Vec<String>,
    devices: Vec<String>,
    cpu: syn::Type,
    cpu_error: syn::Type,
}

impl VisitMut for Specialise {
    fn visit_type_mut(&mut self, ty: &mut syn::Type) {
        if let syn::Type::Path(p) = ty {
            let segs: Vec<String> = p
                .path
                .segments
                .iter()
                .map(|s| s.ident.to_string())
                .collect();
            let first = segs.first().cloned().unwrap_or_default();
            if p.qself.is_none() && segs.len() == 1 && self.dtypes.contains(&first) {
                *ty = syn::parse_quote!(f32);
                return;
            }
            if p.qself.is_none() && segs.len() == 1 && self.devices.contains(&first) {
                *ty = self.cpu.clone();
                return;
            }
            if p.qself.is_none()
                && segs.len() == 2
                && self.devices.contains(&first)
                && segs[1] == "Err"
            {
                *ty = self.cpu_error.clone();
                return;
            }
            if let Some(q) = &p.qself
                && matches!(&*q.ty, syn::Type::Path(tp) if tp.path.get_ident().is_some_and(|i| self.devices.contains(&i.to_string())))
                && segs.last().is_some_and(|s| s == "Err")
            {
                *ty = self.cpu_error.clone();
                return;
            }
        }
        syn::visit_mut::visit_type_mut(self, ty);
    }
}

/// Specialises a step generic over its model: `E: Dtype` -> `f32`, `D: Device<E>` -> `Cpu`, and
/// the working-copy bounds added. Returns `false` (and changes nothing) when the master's type
/// is not a type parameter.
pub(crate) fn specialise(
    f: &mut syn::ItemFn,
    master: &syn::Expr,
    root: &TokenStream,
    half: &TokenStream,
    cuda: bool,
) -> bool {
    let syn::Expr::Path(mp) = super::roles::place(master) else {
        return false;
    };
    let Some(master_name) = mp.path.get_ident() else {
        return false;
    };
    // The master parameter's type: `M`, `&mut M` or `&M` with `M` a type parameter.
    let master_ty = f.sig.inputs.iter().find_map(|a| match a {
        syn::FnArg::Typed(pt) if matches!(&*pt.pat, syn::Pat::Ident(pi) if pi.ident == *master_name) => {
            let ty = match &*pt.ty {
                syn::Type::Reference(r) => &*r.elem,
                other => other,
            };
            match ty {
                syn::Type::Path(p) => p.path.get_ident().cloned(),
                _ => None,
            }
        }
        _ => None,
    });
    let Some(m) = master_ty else { return false };
    let is_param = f
        .sig
        .generics
        .params
        .iter()
        .any(|p| matches!(p, syn::GenericParam::Type(t) if t.ident == m));
    if !is_param {
        return false;
    }
    let mut dtypes = Vec::new();
    let mut devices = Vec::new();
    for p in &f.sig.generics.params {
        if let syn::GenericParam::Type(t) = p {
            let name = t.ident.to_string();
            for b in bounds_of(&f.sig.generics, &name) {
                match bound_name(b).map(|(n, _)| n).as_deref() {
                    Some("Dtype") => dtypes.push(name.clone()),
                    Some("Device") => devices.push(name.clone()),
                    _ => {}
                }
            }
        }
    }
    // The model's forward bound: `M: ModuleMut<X, ..>` or `Module<X, ..>`.
    let forward = bounds_of(&f.sig.generics, &m.to_string())
        .into_iter()
        .find_map(|b| {
            let (name, seg) = bound_name(b)?;
            if name != "ModuleMut" && name != "Module" {
                return None;
            }
            let syn::PathArguments::AngleBracketed(args) = &seg.arguments else {
                return None;
            };
            let x = args.args.iter().find_map(|a| match a {
                syn::GenericArgument::Type(t) => Some(t.clone()),
                _ => None,
            })?;
            Some((syn::Ident::new(&name, proc_macro2::Span::call_site()), x))
        });
    // Drop the dtype and device parameters and their predicates, then substitute.
    let gone = |name: &str| dtypes.iter().chain(&devices).any(|d| d == name);
    f.sig.generics.params = f
        .sig
        .generics
        .params
        .iter()
        .filter(|p| !matches!(p, syn::GenericParam::Type(t) if gone(&t.ident.to_string())))
        .cloned()
        .collect();
    if let Some(w) = &mut f.sig.generics.where_clause {
        w.predicates = w
            .predicates
            .iter()
            .filter(|pred| {
                !matches!(pred, syn::WherePredicate::Type(pt)
                    if matches!(&pt.bounded_ty, syn::Type::Path(p) if p.path.get_ident().is_some_and(|i| gone(&i.to_string()))))
            })
            .cloned()
            .collect();
    }
    // The device the step names (`Cuda`), else the `Cpu`.
    let (device, device_error): (syn::Type, syn::Type) = if cuda {
        (
            syn::parse_quote!(#root::__dfdx::tensor::Cuda),
            syn::parse_quote!(#root::__dfdx::tensor::CudaError),
        )
    } else {
        (
            syn::parse_quote!(#root::__dfdx::tensor::Cpu),
            syn::parse_quote!(#root::__dfdx::tensor::CpuError),
        )
    };
    let mut s = Specialise {
        dtypes: dtypes.clone(),
        devices: devices.clone(),
        cpu: device.clone(),
        cpu_error: device_error.clone(),
    };
    s.visit_signature_mut(&mut f.sig);
    s.visit_block_mut(&mut f.block);
    let Some((module, mut x)) = forward else {
        return true;
    };
    s.visit_type_mut(&mut x);
    let dfdx = quote!(#root::__dfdx);
    // The working copy's type written out with the element type itself: a where clause on
    // `To<<H as Precision>::Elem, Cpu>` would not be normalised to match the body's `To<f16, Cpu>`.
    let elem = elem_of(half, root);
    // The device argument of `HalfInput` / `HalfOutput` (the `Cpu` is their default).
    let on = if cuda { quote!(, #device) } else { quote!() };
    let wc = quote!(<#m as #dfdx::nn::tensor_collection::TensorCollection<f32, #device>>::To<#elem, #device>);
    // A concrete f32 tensor's half type is written out (rustc does not normalise
    // `<Tensor<..> as HalfInput<H>>::Half` inside a where clause to the body's type).
    let half_x = concrete_half(&x, &elem)
        .unwrap_or_else(|| quote!(<#x as #root::step::HalfInput<#half #on>>::Half));
    // The master's own bound goes where the user declared it (one place for its bounds): the
    // step keeps its masters' state by their type.
    let extra: Vec<syn::TypeParamBound> = vec![syn::parse_quote!('static)];
    let mut placed = false;
    for p in &mut f.sig.generics.params {
        if let syn::GenericParam::Type(t) = p
            && t.ident == m
            && !t.bounds.is_empty()
        {
            t.bounds.extend(extra.iter().cloned());
            placed = true;
        }
    }
    if !placed {
        f.sig
            .generics
            .make_where_clause()
            .predicates
            .push(syn::parse_quote!(#m: #(#extra)+*));
    }
    // A model bounded `M: HalfLayers<H>` runs on its mapped working copy (mpx's layers);
    // any other on its own layers in `H`.
    let mapped = bounds_of(&f.sig.generics, &m.to_string())
        .iter()
        .any(|b| bound_name(b).is_some_and(|(n, _)| n == "HalfLayers"));
    let wc = if mapped && !cuda {
        quote!(<#m as #root::step::HalfLayers<#half>>::Working)
    } else {
        wc
    };
    let collection = if mapped && !cuda {
        quote!()
    } else {
        quote!(#dfdx::nn::tensor_collection::TensorCollection<#elem, #device> +)
    };
    let preds: Vec<syn::WherePredicate> = vec![
        syn::parse_quote!(#wc: #collection #dfdx::nn::#module<#half_x, Error = #device_error>),
        syn::parse_quote!(#x: #root::step::HalfInput<#half #on>),
        syn::parse_quote!(<#wc as #dfdx::nn::#module<#half_x>>::Output:
            #root::step::HalfOutput<#half #on, Full = <#m as #dfdx::nn::#module<#x>>::Output>),
    ];
    f.sig.generics.make_where_clause().predicates.extend(preds);
    true
}

/// `tokens` with every `f32` replaced by `elem`.
fn swap(tokens: TokenStream, elem: &TokenStream) -> TokenStream {
    tokens
        .into_iter()
        .flat_map(|t| match t {
            proc_macro2::TokenTree::Ident(i) if i == "f32" => elem.clone(),
            proc_macro2::TokenTree::Group(g) => {
                let mut ng = proc_macro2::Group::new(g.delimiter(), swap(g.stream(), elem));
                ng.set_span(g.span());
                quote!(#ng)
            }
            other => quote!(#other),
        })
        .collect()
}

/// `x` with its `f32` element (and its tape's) replaced by `elem`, when `x` is a `Tensor` type
/// whose element is `f32`.
fn concrete_half(x: &syn::Type, elem: &TokenStream) -> Option<TokenStream> {
    let syn::Type::Path(p) = x else { return None };
    let last = p.path.segments.last()?;
    if p.qself.is_some() || last.ident != "Tensor" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let is_f32 = |a: &syn::GenericArgument| matches!(a, syn::GenericArgument::Type(syn::Type::Path(t)) if t.path.is_ident("f32"));
    if !args.args.iter().nth(1).is_some_and(is_f32) {
        return None;
    }
    Some(swap(quote!(#x), elem))
}

/// The element type of a precision named in tokens (`f16`, `AMP<f16>`: themselves; emulated
/// `bf16` and `f32`: `f32`).
fn elem_of(half: &TokenStream, root: &TokenStream) -> TokenStream {
    let s = half.to_string().replace(' ', "");
    if s.ends_with("bf16") || s == "f32" {
        quote!(f32)
    } else if s.contains("AMP") {
        quote!(#root::precision::AMP<#root::precision::f16>)
    } else if s.ends_with("::f16") || s == "f16" {
        quote!(#root::precision::f16)
    } else {
        quote!(<#half as #root::precision::Precision>::Elem)
    }
}

#[cfg(test)]
mod tests {
    use proc_macro2::TokenStream;
    use quote::quote;

    /// `#[mixed_step(args)]` on `fn train<generics>(params) -> Result<(), D::Err>`, a step generic
    /// over its model, element and device: its expansion, without spaces.
    fn expand_train(args: TokenStream, generics: &TokenStream, params: &TokenStream) -> String {
        let out = crate::mixed_step::expand(
            args,
            quote!(
                fn train<#generics>(#params) -> Result<(), D::Err> {
                    let grads = model.try_alloc_grads()?;
                    let y = model.try_forward_mut(x.traced(grads))?;
                    let grads = y.mean().try_backward()?;
                    opt.update(model, &grads).unwrap();
                    Ok(())
                }
            ),
        );
        out.to_string().replace(' ', "")
    }

    #[test]
    fn a_generic_step_is_specialised_to_f32_on_the_cpu_with_working_copy_bounds() {
        let s = expand_train(
            quote!(scaling = scaler),
            &quote!(
                I: Trace<E, D>,
                M: ModuleMut<I::Traced, Error = D::Err> + TensorCollection<E, D>,
                O: Optimizer<M, D, E>,
                E: Dtype,
                D: Device<E>,
            ),
            &quote!(model: &mut M, opt: &mut O, x: I, scaler: &mut GradScaler<bf16>),
        );
        // E and D are gone, replaced by f32 and Cpu (and D::Err by CpuError).
        assert!(s.contains("fntrain<I:Trace<f32,::mpx::__private::mpx_runtime::__dfdx::tensor::Cpu>,M:ModuleMut<I::Traced,Error=::mpx::__private::mpx_runtime::__dfdx::tensor::CpuError>"), "{s}");
        assert!(!s.contains("E:Dtype") && !s.contains("D:Device"), "{s}");
        assert!(
            s.contains("->Result<(),::mpx::__private::mpx_runtime::__dfdx::tensor::CpuError>"),
            "{s}"
        );
        // The working copy's bounds, in the scaler's precision (emulated bf16: f32 elements).
        assert!(s.contains("<Mas::mpx::__private::mpx_runtime::__dfdx::nn::tensor_collection::TensorCollection<f32,::mpx::__private::mpx_runtime::__dfdx::tensor::Cpu>>::To<f32,::mpx::__private::mpx_runtime::__dfdx::tensor::Cpu>:"), "{s}");
        assert!(
            s.contains("I::Traced:::mpx::__private::mpx_runtime::step::HalfInput<bf16>"),
            "{s}"
        );
        assert!(s.contains("scaler_of::<bf16,_>"), "{s}");
        assert!(s.contains("M:ModuleMut<I::Traced,Error=::mpx::__private::mpx_runtime::__dfdx::tensor::CpuError>+TensorCollection<f32,::mpx::__private::mpx_runtime::__dfdx::tensor::Cpu>+'static"), "{s}");
    }

    #[test]
    fn a_generic_step_that_names_cuda_is_specialised_to_cuda() {
        let s = expand_train(
            quote!(scaling = scaler, half = f16),
            &quote!(
                M: ModuleMut<Tensor<Rank2<4, 8>, E, D, OwnedTape<E, D>>, Error = D::Err>
                    + TensorCollection<E, D>,
                O: Optimizer<M, D, E>,
                E: Dtype,
                D: Device<E>,
            ),
            &quote!(
                model: &mut M,
                opt: &mut O,
                x: Tensor<Rank2<4, 8>, E, D>,
                scaler: &mut GradScaler<f16>,
                _on: &Cuda,
            ),
        );
        let cuda = "::mpx::__private::mpx_runtime::__dfdx::tensor::Cuda";
        assert!(s.contains(&format!("->Result<(),{cuda}Error>")), "{s}");
        assert!(
            s.contains(&format!(
                "HalfInput<::mpx::__private::mpx_runtime::precision::f16,{cuda}>"
            )),
            "{s}"
        );
        // a Cuda model is not `Send`: the master gets `'static` alone
        assert!(!s.contains("::core::marker::Send"), "{s}");
    }
}
