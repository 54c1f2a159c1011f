//! What `#[half_forward]` rewrites in a twin's code, once the element type and the device are
//! concrete ([`Concrete`]): the paths through them and the ops of half tensors as mpx's.

use proc_macro2::TokenStream;
use quote::quote;
use syn::visit_mut::VisitMut;

/// `num_traits::FromPrimitive`'s functions, which `E: Dtype` brings.
const FROM_PRIMITIVE: &[&str] = &[
    "from_isize",
    "from_i8",
    "from_i16",
    "from_i32",
    "from_i64",
    "from_i128",
    "from_usize",
    "from_u8",
    "from_u16",
    "from_u32",
    "from_u64",
    "from_u128",
    "from_f32",
    "from_f64",
];

/// `num_traits::ToPrimitive`'s methods, which `E: Dtype` brings (called by path:
/// `E::to_f32(&x)`).
const TO_PRIMITIVE: &[&str] = &[
    "to_isize", "to_i8", "to_i16", "to_i32", "to_i64", "to_i128", "to_usize", "to_u8", "to_u16",
    "to_u32", "to_u64", "to_u128", "to_f32", "to_f64",
];

/// The element-wise tensor methods (each also in its `try_` form) that run as mpx's layers.
const METHODS: &[&str] = &[
    "relu",
    "tanh",
    "sigmoid",
    "fast_gelu",
    "accurate_gelu",
    "abs",
    "square",
    "sqrt",
    "sin",
    "cos",
];

/// Makes the element type `stored` and the device `Cpu` everywhere in an impl: in types, and in
/// paths through them (`E::from_f32(..)`, `E::ONE`, `D::Err`: [`Concrete::qualified`]). In its code,
/// the activations written as tensor methods, the element-wise `+`, `-`, `*`, `/` (and
/// `try_add`, `try_sub`, `try_mul`, `try_div`), negation and `matmul` / `try_matmul` run as mpx's
/// ops where their operands are half tensors, or a half tensor and a scalar.
pub(super) struct Concrete<'a> {
    pub(super) elem: &'a syn::Ident,
    pub(super) dev: Option<&'a syn::Ident>,
    pub(super) stored: &'a syn::Type,
    pub(super) rt: &'a TokenStream,
    /// How many const contexts (types, const generic arguments, array lengths, const items)
    /// the visit is inside: no operator there is rewritten.
    pub(super) consts: usize,
    /// Whether the twin stores 16-bit values. Only then are the operators and the products
    /// dispatched: mpx's ops are for f16 tensors, and in a twin of f32 storage (emulated bf16)
    /// the dispatch would only ever run them as written, while its f16 candidates could settle
    /// an operand whose element type the code leaves to inference (`let e: Tensor<S, E, D> =
    /// dev.ones() * s`) as f16.
    pub(super) half_storage: bool,
}

impl Concrete<'_> {
    /// `E::rest` / `D::rest` as a qualified path, or `None` for any other path: the items the
    /// generic code reaches through `E: Dtype` by their traits (`E::from_f32` as
    /// `num_traits::FromPrimitive`'s, not `half::f16`'s inherent one of another signature;
    /// `E::ONE` as dfdx's `Unit`'s), `D::Err` as `Cpu`'s, anything else through the concrete
    /// type as written (`<f16>::default()`, a `num_traits::Float` method the user's own import
    /// brings).
    fn qualified(&self, path: &syn::Path) -> Option<(syn::QSelf, syn::Path)> {
        if path.leading_colon.is_some() || path.segments.len() < 2 {
            return None;
        }
        let first = &path.segments[0].ident;
        let item = path.segments[1].ident.to_string();
        let rt = self.rt;
        let (ty, tr): (syn::Type, Option<syn::Path>) = if first == self.elem {
            let tr: Option<syn::Path> = if FROM_PRIMITIVE.contains(&item.as_str()) {
                Some(syn::parse_quote!(#rt::__private::num_traits::FromPrimitive))
            } else if TO_PRIMITIVE.contains(&item.as_str()) {
                Some(syn::parse_quote!(#rt::__private::num_traits::ToPrimitive))
            } else if item == "ONE" {
                Some(syn::parse_quote!(#rt::__private::dfdx::dtypes::Unit))
            } else {
                None
            };
            (self.stored.clone(), tr)
        } else if self.dev.is_some_and(|d| first == d) {
            let tr: Option<syn::Path> =
                (item == "Err").then(|| syn::parse_quote!(#rt::__private::dfdx::tensor::HasErr));
            (syn::parse_quote!(#rt::__private::dfdx::tensor::Cpu), tr)
        } else {
            return None;
        };
        let rest = path.segments.iter().skip(1);
        let qualified: syn::ExprPath = match tr {
            Some(tr) => syn::parse_quote!(<#ty as #tr>#(::#rest)*),
            None => syn::parse_quote!(<#ty>#(::#rest)*),
        };
        Some((qualified.qself?, qualified.path))
    }
}

impl Concrete<'_> {
    /// Runs `f` inside a const context (see [`Concrete::consts`]).
    fn in_const(&mut self, f: impl FnOnce(&mut Self)) {
        self.consts += 1;
        f(self);
        self.consts -= 1;
    }

    /// The element type and the device made concrete in a type.
    fn concrete_type(&mut self, t: &mut syn::Type) {
        if let syn::Type::Path(p) = t
            && p.qself.is_none()
        {
            if let Some(id) = p.path.get_ident() {
                if id == self.elem {
                    *t = self.stored.clone();
                    return;
                }
                if self.dev.is_some_and(|d| id == d) {
                    let rt = self.rt;
                    *t = syn::parse_quote!(#rt::__private::dfdx::tensor::Cpu);
                    return;
                }
            }
            if let Some((qself, path)) = self.qualified(&p.path) {
                p.qself = Some(qself);
                p.path = path;
                return;
            }
        }
        syn::visit_mut::visit_type_mut(self, t);
    }

    /// `a op b` (or `a.method(b)`) as mpx's op where both are half tensors, else exactly as
    /// written (`written`, given the two operands' names), on the same two values.
    fn binary(
        &self,
        (a, b): (&syn::Expr, &syn::Expr),
        (half, dispatch): (&str, &str),
        written: impl FnOnce(&syn::Ident, &syn::Ident) -> TokenStream,
    ) -> syn::Expr {
        let rt = self.rt;
        let site = proc_macro2::Span::call_site();
        let dispatch = syn::Ident::new(dispatch, site);
        // an operand's own parentheses are not needed as an argument (nor warned about)
        let unparen = |mut e: &syn::Expr| -> syn::Expr {
            while let syn::Expr::Paren(p) = e {
                e = &p.expr;
            }
            e.clone()
        };
        let (a, b) = (unparen(a), unparen(b));
        let half = syn::Ident::new(half, site);
        let (x, y) = (
            syn::Ident::new("__mpx_a", site),
            syn::Ident::new("__mpx_b", site),
        );
        let written = written(&x, &y);
        syn::parse_quote!({
            use #rt::__private::binary::{AsWritten as _, #half as _};
            let __mpx_ops = #rt::__private::binary::Operands::new(#a, #b);
            match (&__mpx_ops).#dispatch() {
                ::core::option::Option::Some(__mpx_out) => __mpx_out,
                ::core::option::Option::None => {
                    let (#x, #y) = __mpx_ops.into_inner();
                    #written
                }
            }
        })
    }

    /// `-a` or `a.method()` as mpx's op where `a` is a half tensor, else as written: the
    /// dispatch of [`Concrete::binary`] on the operands `(a, ())`.
    fn unary(
        &self,
        a: &syn::Expr,
        (half, dispatch): (&str, &str),
        written: impl FnOnce(&syn::Ident) -> TokenStream,
    ) -> syn::Expr {
        let unit: syn::Expr = syn::parse_quote!(());
        self.binary((a, &unit), (half, dispatch), |x, y| {
            let written = written(x);
            quote!({
                let () = #y;
                #written
            })
        })
    }
}

impl VisitMut for Concrete<'_> {
    fn visit_generic_argument_mut(&mut self, g: &mut syn::GenericArgument) {
        self.in_const(|v| syn::visit_mut::visit_generic_argument_mut(v, g));
    }

    fn visit_item_const_mut(&mut self, i: &mut syn::ItemConst) {
        self.in_const(|v| syn::visit_mut::visit_item_const_mut(v, i));
    }

    fn visit_item_static_mut(&mut self, i: &mut syn::ItemStatic) {
        self.in_const(|v| syn::visit_mut::visit_item_static_mut(v, i));
    }

    fn visit_type_mut(&mut self, t: &mut syn::Type) {
        self.in_const(|v| v.concrete_type(t));
    }

    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        match e {
            // an array's length and a `const` block are const contexts
            syn::Expr::Repeat(r) => {
                self.visit_expr_mut(&mut r.expr);
                self.in_const(|v| v.visit_expr_mut(&mut r.len));
                return;
            }
            syn::Expr::Const(c) => {
                self.in_const(|v| syn::visit_mut::visit_expr_const_mut(v, c));
                return;
            }
            _ => syn::visit_mut::visit_expr_mut(self, e),
        }
        if self.consts > 0 {
            return;
        }
        // the element-wise ops and the matrix product of two half tensors (and the element-wise
        // ops of a half tensor and a scalar) run as mpx's (`nn::binary`, `nn::matmul`); any
        // other operands, as written. A method's receiver that is a field is left alone: moving
        // it out would not compile (and a tensor's `try_add` / `matmul`, which take it by value,
        // cannot have one there).
        let rewritten = match &*e {
            _ if !self.half_storage => None,
            syn::Expr::Binary(bin) => {
                let dispatch = match bin.op {
                    syn::BinOp::Add(_) => Some("add_op"),
                    syn::BinOp::Sub(_) => Some("sub_op"),
                    syn::BinOp::Mul(_) => Some("mul_op"),
                    syn::BinOp::Div(_) => Some("div_op"),
                    _ => None,
                };
                dispatch.map(|d| {
                    let op = bin.op;
                    self.binary(
                        (&bin.left, &bin.right),
                        ("HalfOps", d),
                        |x, y| quote!(#x #op #y),
                    )
                })
            }
            // `-a` (a literal is a number: left as written)
            syn::Expr::Unary(u)
                if matches!(u.op, syn::UnOp::Neg(_)) && !matches!(&*u.expr, syn::Expr::Lit(_)) =>
            {
                Some(self.unary(&u.expr, ("HalfOps", "neg_op"), |x| quote!(-#x)))
            }
            syn::Expr::MethodCall(m)
                if m.args.len() == 1
                    && m.turbofish.is_none()
                    && !matches!(&*m.receiver, syn::Expr::Field(_)) =>
            {
                let dispatch = match m.method.to_string().as_str() {
                    "try_add" => Some(("HalfOps", "try_add_op")),
                    "try_sub" => Some(("HalfOps", "try_sub_op")),
                    "try_mul" => Some(("HalfOps", "try_mul_op")),
                    "try_div" => Some(("HalfOps", "try_div_op")),
                    "matmul" => Some(("HalfMatMul", "matmul_op")),
                    "try_matmul" => Some(("HalfMatMul", "try_matmul_op")),
                    _ => None,
                };
                dispatch.map(|d| {
                    let method = &m.method;
                    self.binary((&m.receiver, &m.args[0]), d, |x, y| quote!(#x.#method(#y)))
                })
            }
            _ => None,
        };
        if let Some(r) = rewritten {
            *e = r;
            return;
        }
        // the element-wise methods of a half tensor run as the layers of the same names do in
        // the working copy (`x.tanh()` as `nn::Tanh`, `x.try_square()` as `nn::InF32` of
        // dfdx's `Square`); of anything else (a number's `x.sqrt()`), as written
        if let syn::Expr::MethodCall(m) = e
            && m.args.is_empty()
            && m.turbofish.is_none()
        {
            let name = m.method.to_string();
            let base = name.strip_prefix("try_").unwrap_or(&name);
            if !METHODS.contains(&base) {
                return;
            }
            let dispatch = format!("{name}_op");
            let method = &m.method;
            *e = self.unary(
                &m.receiver,
                ("HalfMethods", &dispatch),
                |x| quote!(#x.#method()),
            );
        }
    }

    fn visit_expr_path_mut(&mut self, e: &mut syn::ExprPath) {
        if e.qself.is_none()
            && let Some((qself, path)) = self.qualified(&e.path)
        {
            e.qself = Some(qself);
            e.path = path;
            return;
        }
        syn::visit_mut::visit_expr_path_mut(self, e);
    }
}
