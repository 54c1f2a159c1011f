//! Containers: `Vec`, arrays, `Option`, `Box`, tuples (up to 8) and map values. Each casts its
//! elements and keeps its structure; map keys are cloned as they are.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash};

use super::{Cast, FloatLeaves, FloatSliceMut};
use crate::precision::{FloatSlice, Precision};

impl<P: Precision, T: Cast<P>> Cast<P> for Vec<T> {
    type Output = Vec<T::Output>;
    fn cast(&self) -> Self::Output {
        self.iter().map(Cast::cast).collect()
    }
}
impl<T: FloatLeaves> FloatLeaves for Vec<T> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        self.iter().all(|x| x.visit_floats(visit))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        for x in self.iter_mut() {
            x.visit_floats_mut(visit);
        }
    }
}

impl<P: Precision, T: Cast<P>, const N: usize> Cast<P> for [T; N] {
    type Output = [T::Output; N];
    fn cast(&self) -> Self::Output {
        std::array::from_fn(|i| self[i].cast())
    }
}
impl<T: FloatLeaves, const N: usize> FloatLeaves for [T; N] {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        self.iter().all(|x| x.visit_floats(visit))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        for x in self.iter_mut() {
            x.visit_floats_mut(visit);
        }
    }
}

impl<P: Precision, T: Cast<P>> Cast<P> for Option<T> {
    type Output = Option<T::Output>;
    fn cast(&self) -> Self::Output {
        self.as_ref().map(Cast::cast)
    }
}
impl<T: FloatLeaves> FloatLeaves for Option<T> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        self.as_ref().is_none_or(|x| x.visit_floats(visit))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        if let Some(x) = self {
            x.visit_floats_mut(visit);
        }
    }
}

impl<P: Precision, T: Cast<P>> Cast<P> for Box<T> {
    type Output = Box<T::Output>;
    fn cast(&self) -> Self::Output {
        Box::new((**self).cast())
    }
}
impl<T: FloatLeaves> FloatLeaves for Box<T> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        (**self).visit_floats(visit)
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        (**self).visit_floats_mut(visit);
    }
}

impl<P: Precision, K: Clone + Eq + Hash, V: Cast<P>, St: BuildHasher + Clone> Cast<P>
    for HashMap<K, V, St>
{
    type Output = HashMap<K, V::Output, St>;
    fn cast(&self) -> Self::Output {
        let mut out = HashMap::with_capacity_and_hasher(self.len(), self.hasher().clone());
        out.extend(self.iter().map(|(k, v)| (k.clone(), v.cast())));
        out
    }
}
/// Map values are visited in the map's iteration order, which for `HashMap` is fixed for a given
/// map but not across maps: prefer `BTreeMap` where two trees must line up leaf by leaf.
impl<K, V: FloatLeaves, St> FloatLeaves for HashMap<K, V, St> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        self.values().all(|x| x.visit_floats(visit))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        for x in self.values_mut() {
            x.visit_floats_mut(visit);
        }
    }
}

impl<P: Precision, K: Clone + Ord, V: Cast<P>> Cast<P> for BTreeMap<K, V> {
    type Output = BTreeMap<K, V::Output>;
    fn cast(&self) -> Self::Output {
        self.iter().map(|(k, v)| (k.clone(), v.cast())).collect()
    }
}
impl<K, V: FloatLeaves> FloatLeaves for BTreeMap<K, V> {
    fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        self.values().all(|x| x.visit_floats(visit))
    }
    fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
        for x in self.values_mut() {
            x.visit_floats_mut(visit);
        }
    }
}

macro_rules! tuple {
    ($(($t:ident, $i:tt)),+) => {
        impl<P: Precision, $($t: Cast<P>),+> Cast<P> for ($($t,)+) {
            type Output = ($($t::Output,)+);
            fn cast(&self) -> Self::Output {
                ($(self.$i.cast(),)+)
            }
        }
        impl<$($t: FloatLeaves),+> FloatLeaves for ($($t,)+) {
            fn visit_floats(&self, visit: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
                $(self.$i.visit_floats(visit))&&+
            }
            fn visit_floats_mut(&mut self, visit: &mut dyn FnMut(FloatSliceMut<'_>)) {
                $(self.$i.visit_floats_mut(visit);)+
            }
        }
    };
}
tuple!((A, 0));
tuple!((A, 0), (B, 1));
tuple!((A, 0), (B, 1), (C, 2));
tuple!((A, 0), (B, 1), (C, 2), (D, 3));
tuple!((A, 0), (B, 1), (C, 2), (D, 3), (E, 4));
tuple!((A, 0), (B, 1), (C, 2), (D, 3), (E, 4), (F, 5));
tuple!((A, 0), (B, 1), (C, 2), (D, 3), (E, 4), (F, 5), (G, 6));
tuple!(
    (A, 0),
    (B, 1),
    (C, 2),
    (D, 3),
    (E, 4),
    (F, 5),
    (G, 6),
    (H, 7)
);

/// `PhantomData<T>` becomes `PhantomData<T::Output>`: a struct's `PhantomData<E>` marker follows
/// its dtype parameter (`PhantomData<f32>` cast to f16 is `PhantomData<f16>`).
impl<P: Precision, T: Cast<P>> Cast<P> for std::marker::PhantomData<T> {
    type Output = std::marker::PhantomData<T::Output>;
    fn cast(&self) -> Self::Output {
        std::marker::PhantomData
    }
}
impl<T> FloatLeaves for std::marker::PhantomData<T> {
    fn visit_floats(&self, _: &mut dyn FnMut(FloatSlice<'_>) -> bool) -> bool {
        true
    }
    fn visit_floats_mut(&mut self, _: &mut dyn FnMut(FloatSliceMut<'_>)) {}
}
