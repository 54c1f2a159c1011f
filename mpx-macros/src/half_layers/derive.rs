//! `#[derive(HalfLayers)]`: parse the struct and its `#[half_layers(..)]` attributes, validate
//! its parameters and sort its fields, expand the working struct and the two impls.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;

use super::{param_bounded_by, working_name};
use crate::ctxt::{Ctxt, parse_attrs, runtime_path, set_crate, set_parsed};

/// Keys the struct's `#[half_layers(..)]` accepts.
const CONTAINER_KEYS: &str = "`dtype`, `device`, `crate`";
/// Keys a field's `#[half_layers(..)]` accepts.
const FIELD_KEYS: &str = "`keep`, `state`";

/// Field types carried into the working copy as they are (cloned), even where they name the
/// element type (which is then an error: a `Vec<E>` of numbers, an `Option` of a tensor).
const KEPT: &[&str] = &[
    "f32",
    "f64",
    "i8",
    "i16",
    "i32",
    "i64",
    "i128",
    "isize",
    "u8",
    "u16",
    "u32",
    "u64",
    "u128",
    "usize",
    "bool",
    "char",
    "String",
    "Option",
    "Vec",
    "PhantomData",
    "Box",
    "Rc",
    "Arc",
    "HashMap",
    "HashSet",
    "BTreeMap",
    "BTreeSet",
    "VecDeque",
    "Duration",
    "StdRng",
    "SmallRng",
];

/// What a field becomes in the working copy.
enum Role {
    /// A layer: its mapped working copy (`<L as HalfLayers<H>>::Working`).
    Layer,
    /// A float tensor: in the precision's element type; `state`: not trained.
    Tensor { state: bool },
    /// Anything else: cloned as it is.
    Keep,
}

struct Field<'a> {
    member: syn::Member,
    /// The field's name as dfdx's visitors name it (`"w"`, `"0"`).
    name: String,
    vis: &'a syn::Visibility,
    ty: &'a syn::Type,
    role: Role,
    /// Marked `#[half_layers(keep)]`.
    keep: bool,
}

/// Entry point: the generated items, or the collected errors.
pub(crate) fn expand(input: TokenStream) -> TokenStream {
    let input: syn::DeriveInput = match syn::parse2(input) {
        Ok(input) => input,
        Err(err) => return err.to_compile_error(),
    };
    let mut cx = Ctxt::default();
    let (krate, dtype, device) = container_args(&input, &mut cx);
    let elem = dtype.or_else(|| param_bounded_by(&input.generics, &["Dtype"]));
    let dev = device.or_else(|| param_bounded_by(&input.generics, &["Device", "Storage"]));
    let fields = fields(&input, (elem.as_ref(), dev.as_ref()), &mut cx);
    if elem.is_none() {
        cx.error_spanned(
            &input.ident,
            "`#[derive(HalfLayers)]` needs the module generic over its element type, as dfdx's layers are (`struct Net<E: Dtype, D: Device<E>> { .. }`), or that parameter named with `#[half_layers(dtype = E)]`",
        );
    }
    for p in &input.generics.params {
        match p {
            syn::GenericParam::Lifetime(l) => cx.error_spanned(
                l,
                "`#[derive(HalfLayers)]`: a module with lifetime parameters has no working copy",
            ),
            syn::GenericParam::Type(t)
                if Some(&t.ident) != elem.as_ref() && Some(&t.ident) != dev.as_ref() =>
            {
                cx.error_spanned(
                    t,
                    "`#[derive(HalfLayers)]`: a module's type parameters other than its element type and its device are not supported",
                );
            }
            _ => {}
        }
    }
    if let Some(elem) = &elem {
        for f in &fields {
            let last = match f.ty {
                syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
                _ => None,
            };
            let marker = last.as_deref() == Some("PhantomData");
            if matches!(f.role, Role::Keep)
                && last
                    .as_deref()
                    .is_some_and(|l| ["Cell", "RefCell", "OnceCell"].contains(&l))
            {
                cx.error_spanned(
                    f.ty,
                    "`#[derive(HalfLayers)]`: this field is cloned into each forward pass's working copy, so what a `forward(&self)` pass sets in it would not reach the module; hold it shared, in an `Arc<Mutex<..>>` or an `Arc<AtomicUsize>`, which the copy shares; a plain field (a `usize`) that `forward_mut` changes comes back to the module",
                );
            }
            if matches!(f.role, Role::Keep) && mentions(f.ty, elem) && !marker {
                let msg = if f.keep {
                    "`#[derive(HalfLayers)]`: this field is carried into the working copy as it is (its device as `Cpu`), so it must not mention the element type; if it is a layer, it needs `HalfLayers` (remove `#[half_layers(keep)]`)"
                } else {
                    "`#[derive(HalfLayers)]`: a field of this type (a `Vec`, an `Option`, a `Box`, ..) is carried into the working copy as it is, in f32, so it must not hold the element type: a layer or a tensor in it would neither run in half precision nor train there; hold layers in a tuple or dfdx's `Repeated<L, N>`, and a tensor in a `Tensor` field of its own (`#[half_layers(state)]` when its walk does not train it)"
                };
                cx.error_spanned(f.ty, msg);
            }
        }
    }
    match (cx.check(), elem) {
        (Ok(()), Some(elem)) => generate(&input, &fields, &elem, dev.as_ref(), krate.as_ref()),
        (Err(err), _) => err.to_compile_error(),
        (Ok(()), None) => TokenStream::new(),
    }
}

/// `#[half_layers(dtype = E, device = D, crate = "path")]` on the struct.
fn container_args(
    input: &syn::DeriveInput,
    cx: &mut Ctxt,
) -> (Option<syn::Path>, Option<syn::Ident>, Option<syn::Ident>) {
    let (mut krate, mut dtype, mut device) = (None, None, None);
    let expected = format!("one of {CONTAINER_KEYS}");
    let what = ("argument", expected.as_str());
    parse_attrs(
        &input.attrs,
        "half_layers",
        cx,
        what,
        |key, meta, cx| match key {
            "dtype" => set_parsed(meta, cx, &mut dtype, "dtype"),
            "device" => set_parsed(meta, cx, &mut device, "device"),
            "crate" => set_crate(meta, cx, &mut krate),
            _ => Ok(false),
        },
    );
    (krate, dtype, device)
}

/// The struct's fields, each with its role: a `Tensor` of the element type `elem` is a float
/// tensor of the model; one of another element type (`usize` indices, a `bool` mask) is carried.
fn fields<'a>(
    input: &'a syn::DeriveInput,
    (elem, dev): (Option<&syn::Ident>, Option<&syn::Ident>),
    cx: &mut Ctxt,
) -> Vec<Field<'a>> {
    let data = match &input.data {
        syn::Data::Struct(s) => s,
        syn::Data::Enum(e) => {
            cx.error_spanned(
                e.enum_token,
                "`#[derive(HalfLayers)]` applies to a struct (a module of layers and tensors)",
            );
            return Vec::new();
        }
        syn::Data::Union(u) => {
            cx.error_spanned(
                u.union_token,
                "`#[derive(HalfLayers)]` applies to a struct (a module of layers and tensors)",
            );
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    let field_expected = format!("one of {FIELD_KEYS}");
    for (i, f) in data.fields.iter().enumerate() {
        let (mut keep, mut state) = (false, false);
        let what = ("argument", field_expected.as_str());
        parse_attrs(&f.attrs, "half_layers", cx, what, |key, _, _| {
            match key {
                "keep" => keep = true,
                "state" => state = true,
                _ => return Ok(false),
            }
            Ok(true)
        });
        let last = match &f.ty {
            syn::Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
            _ => None,
        };
        let name = last.map(|s| s.ident.to_string());
        let role = if keep {
            Role::Keep
        } else if name.as_deref() == Some("Tensor") {
            if last.is_some_and(|s| of_elem(s, elem)) {
                Role::Tensor { state }
            } else {
                Role::Keep
            }
        } else if name.as_deref().is_some_and(|l| KEPT.contains(&l))
            || dev.is_some_and(|d| matches!(&f.ty, syn::Type::Path(p) if p.path.is_ident(d)))
        {
            Role::Keep
        } else if name.is_some() || elem.is_none_or(|e| mentions(&f.ty, e)) {
            // a module of the user's own, a layer of dfdx's (`ReLU` names no element type; a
            // type of the user's own that is no layer is an error at its type, which names
            // `#[half_layers(keep)]`), a tuple of layers or `<Spec as BuildOnDevice<D, E>>::Built`
            Role::Layer
        } else {
            // a tuple or an array of numbers
            Role::Keep
        };
        if state && !matches!(role, Role::Tensor { .. }) {
            cx.error_spanned(
                &f.ty,
                "`#[half_layers(state)]` marks a tensor field that is not trained (a running statistic)",
            );
        }
        let (member, name) = match &f.ident {
            Some(id) => (syn::Member::Named(id.clone()), id.to_string()),
            None => (syn::Member::Unnamed(i.into()), i.to_string()),
        };
        out.push(Field {
            member,
            name,
            vis: &f.vis,
            ty: &f.ty,
            role,
            keep,
        });
    }
    out
}

/// Whether `Tensor<S, E, D, ..>`'s element argument is `elem` (no element type known: taken as
/// one, the derive's error on the missing parameter stands for it).
fn of_elem(tensor: &syn::PathSegment, elem: Option<&syn::Ident>) -> bool {
    let Some(elem) = elem else {
        return true;
    };
    match &tensor.arguments {
        syn::PathArguments::AngleBracketed(a) => matches!(
            a.args.iter().nth(1),
            Some(syn::GenericArgument::Type(syn::Type::Path(p))) if p.path.is_ident(elem)
        ),
        _ => false,
    }
}

/// Whether `ty` names `elem`.
fn mentions(ty: &syn::Type, elem: &syn::Ident) -> bool {
    struct Find<'a>(&'a syn::Ident, bool);
    impl<'ast> syn::visit::Visit<'ast> for Find<'_> {
        fn visit_path(&mut self, p: &'ast syn::Path) {
            if p.segments
                .first()
                .is_some_and(|first| first.ident == *self.0)
            {
                self.1 = true;
            }
            syn::visit::visit_path(self, p);
        }
    }
    let mut f = Find(elem, false);
    syn::visit::Visit::visit_type(&mut f, ty);
    f.1
}

/// Replaces the element type and the device in a type.
struct Subst<'a> {
    elem: &'a syn::Ident,
    dev: Option<&'a syn::Ident>,
    elem_to: syn::Type,
    dev_to: syn::Type,
}

impl VisitMut for Subst<'_> {
    fn visit_type_mut(&mut self, t: &mut syn::Type) {
        if let syn::Type::Path(p) = t
            && p.qself.is_none()
            && let Some(id) = p.path.get_ident()
        {
            if id == self.elem {
                *t = self.elem_to.clone();
                return;
            }
            if self.dev.is_some_and(|d| id == d) {
                *t = self.dev_to.clone();
                return;
            }
        }
        syn::visit_mut::visit_type_mut(self, t);
    }
}

fn generate(
    input: &syn::DeriveInput,
    fields: &[Field<'_>],
    elem: &syn::Ident,
    dev: Option<&syn::Ident>,
    krate: Option<&syn::Path>,
) -> TokenStream {
    let rt = runtime_path(krate);
    let dfdx = quote!(#rt::__private::dfdx);
    let name = &input.ident;
    let working = working_name(name);
    let vis = &input.vis;
    let cpu: syn::Type = syn::parse_quote!(#dfdx::tensor::Cpu);
    let h_elem: syn::Type = syn::parse_quote!(<__H as #rt::precision::Precision>::Elem);
    let subst = |ty: &syn::Type, elem_to: &syn::Type| {
        let mut ty = ty.clone();
        Subst {
            elem,
            dev,
            elem_to: elem_to.clone(),
            dev_to: cpu.clone(),
        }
        .visit_type_mut(&mut ty);
        ty
    };
    let f32_ty: syn::Type = syn::parse_quote!(f32);

    // the const parameters, kept; the element type and the device, made f32 and Cpu
    let consts: Vec<&syn::ConstParam> = input.generics.const_params().collect();
    let const_idents: Vec<&syn::Ident> = consts.iter().map(|c| &c.ident).collect();
    let master_args = input.generics.params.iter().map(|p| match p {
        syn::GenericParam::Const(c) => {
            let id = &c.ident;
            quote!(#id)
        }
        syn::GenericParam::Type(t) if t.ident == *elem => quote!(f32),
        _ => quote!(#cpu),
    });
    let master = quote!(#name<#(#master_args),*>);

    let layers: Vec<syn::Type> = fields
        .iter()
        .filter(|f| matches!(f.role, Role::Layer))
        .map(|f| subst(f.ty, &f32_ty))
        .collect();
    let bounds = quote! {
        #cpu: #rt::step::MixedDevice<__H>,
        #(#layers: #rt::step::HalfLayers<__H>,)*
    };

    // the working struct's fields
    let field_defs = fields.iter().map(|f| {
        let fvis = f.vis;
        let ty = match f.role {
            Role::Layer => {
                let m = subst(f.ty, &f32_ty);
                quote!(<#m as #rt::step::HalfLayers<__H>>::Working)
            }
            Role::Tensor { .. } => {
                let t = subst(f.ty, &h_elem);
                quote!(#t)
            }
            Role::Keep => {
                let t = subst(f.ty, &f32_ty);
                quote!(#t)
            }
        };
        match &f.member {
            syn::Member::Named(id) => quote!(#fvis #id: #ty),
            syn::Member::Unnamed(_) => quote!(#fvis #ty),
        }
    });
    let tuple_struct = fields
        .first()
        .is_some_and(|f| matches!(f.member, syn::Member::Unnamed(_)));
    let body = if tuple_struct {
        quote!((#(#field_defs),*) where #bounds;)
    } else {
        quote!(where #bounds { #(#field_defs),* })
    };
    let doc = format!(
        "The working copy of [`{name}`] in a mixed step: its layers as mpx's (`#[derive(HalfLayers)]`)."
    );

    // its TensorCollection: layers and tensors, in declaration order, in tuples of at most 6
    let visited: Vec<TokenStream> = fields
        .iter()
        .filter_map(|f| {
            let (m, n) = (&f.member, &f.name);
            match f.role {
                Role::Layer => Some(quote!(Self::module(#n, |s| &s.#m, |s| &mut s.#m))),
                Role::Tensor { state: false } => Some(quote!(Self::tensor(
                    #n, |s| &s.#m, |s| &mut s.#m,
                    #dfdx::nn::tensor_collection::TensorOptions::reset_to_zeros()
                ))),
                Role::Tensor { state: true } => Some(quote!(Self::tensor(
                    #n, |s| &s.#m, |s| &mut s.#m,
                    #dfdx::nn::tensor_collection::TensorOptions::detached(|_| Ok(()))
                ))),
                Role::Keep => None,
            }
        })
        .collect();
    let visited = nest(&visited);

    // the master's HalfLayers: build field by field (each layer finished as it is built)
    let builds = fields.iter().map(|f| {
        let (m, n) = (&f.member, &f.name);
        let value = match f.role {
            Role::Layer => quote!(#rt::step::HalfLayers::<__H>::build_working(&self.#m, cx)?),
            Role::Tensor { state } => {
                let trained = !state;
                quote!(cx.tensor::<Self, _>(&self.#m, #trained, #n)?)
            }
            // a field that is not `Clone` is an error at its type (the span on the path alone:
            // `self` keeps the derive's, as a macro's own tokens must)
            Role::Keep => {
                let clone = quote_spanned!(f.ty.span()=> ::core::clone::Clone::clone);
                quote!(#clone(&self.#m))
            }
        };
        quote!(#m: #value)
    });
    // what a `forward_mut` pass changed outside the layers and tensors, taken back: the carried
    // fields swapped into the master, the layers' own taken back in turn
    let backs = fields.iter().filter_map(|f| {
        let m = &f.member;
        match f.role {
            Role::Layer => Some(
                quote!(#rt::step::HalfLayers::<__H>::carry_back(&mut self.#m, &mut working.#m);),
            ),
            Role::Keep => Some(quote!(::core::mem::swap(&mut self.#m, &mut working.#m);)),
            Role::Tensor { .. } => None,
        }
    });
    let unreachable = format!(
        "`{name}Working` is the working copy of a mixed step: it is not built or converted by dfdx's visitors"
    );

    // every layer field has a working copy of mpx's layers, checked here, at the field's type:
    // without it the impls above would not apply, and the step would run the whole model on
    // dfdx's f16 layers with a warning that names this derive, already written
    let checks = fields
        .iter()
        .filter(|f| matches!(f.role, Role::Layer))
        .map(|f| {
            let m = subst(f.ty, &f32_ty);
            quote_spanned!(f.ty.span()=> __mpx_layer::<#m>();)
        });

    quote! {
        #[doc = #doc]
        #[allow(dead_code)]
        #vis struct #working<#(#consts,)* __H: #rt::precision::Precision> #body

        impl<#(#consts,)* __H: #rt::precision::Precision>
            #dfdx::nn::tensor_collection::TensorCollection<#h_elem, #cpu> for #working<#(#const_idents,)* __H>
        where
            #bounds
        {
            type To<__E2: #dfdx::shapes::Dtype, __D2: #dfdx::tensor_ops::Device<__E2>> = Self;
            fn iter_tensors<__V: #dfdx::nn::tensor_collection::ModuleVisitor<Self, #h_elem, #cpu>>(
                visitor: &mut __V,
            ) -> ::core::result::Result<::core::option::Option<Self>, __V::Err> {
                visitor.visit_fields(#visited, |_| ::core::unreachable!(#unreachable))
            }
        }

        const _: () = {
            #[allow(dead_code)]
            fn __mpx_layers<#(#consts,)*>() {
                fn __mpx_layer<__L: #rt::step::HalfLayers<#rt::precision::f16>>() {}
                #(#checks)*
            }
        };

        impl<#(#consts,)* __H: #rt::precision::Precision> #rt::step::HalfLayers<__H> for #master
        where
            #bounds
        {
            type Working = #working<#(#const_idents,)* __H>;
            fn build_working(
                &self,
                cx: &mut #rt::step::BuildCx<'_, __H>,
            ) -> ::core::result::Result<Self::Working, #rt::step::StepError> {
                ::core::result::Result::Ok(#working { #(#builds),* })
            }
            fn carry_back(&mut self, working: &mut Self::Working) {
                let _ = &working;
                #(#backs)*
            }
        }
    }
}

/// `(a, b, ..)` in nested tuples of at most six (dfdx's `ModuleFields` tuples), `()` for none.
fn nest(items: &[TokenStream]) -> TokenStream {
    if items.len() <= 6 {
        return quote!((#(#items,)*));
    }
    let groups: Vec<TokenStream> = items.chunks(6).map(|c| quote!((#(#c,)*))).collect();
    nest(&groups)
}

#[cfg(test)]
mod tests {
    use quote::quote;

    /// A named type is a layer (`ReLU` too), and so is a tuple that names the element type; the
    /// device, a tuple of numbers, the standard containers and a field marked `keep` are
    /// carried as they are, and taken back after a `forward_mut` pass.
    #[test]
    fn layers_are_named_types_and_tuples_of_the_element_type_and_the_rest_is_carried() {
        let out = super::expand(quote! {
            struct Net<E: Dtype, D: Device<E>> {
                mlp: (Linear<4, 8, E, D>, Tanh),
                act: ReLU,
                #[half_layers(keep)]
                phase: Phase,
                dev: D,
                calls: usize,
                range: (usize, usize),
                seen: HashMap<usize, f32>,
            }
        })
        .to_string()
        .replace(' ', "");
        for layer in ["mlp", "act"] {
            assert!(
                out.contains(&format!(
                    "HalfLayers::<__H>::carry_back(&mutself.{layer},&mutworking.{layer});"
                )),
                "{layer}: {out}"
            );
        }
        assert!(out.contains("mlp:<(Linear<4,8,f32,"), "{out}");
        for kept in ["phase", "dev", "calls", "range", "seen"] {
            assert!(
                out.contains(&format!(
                    "::core::mem::swap(&mutself.{kept},&mutworking.{kept});"
                )),
                "{kept}: {out}"
            );
        }
        assert!(out.contains("phase:Phase,"), "{out}");
        assert!(!out.contains("compile_error"), "{out}");
    }
}
