//! Einsum: the output dims its equation names.

use std::collections::BTreeMap;

use super::context::{Ctx, Outs, one, ty_opt};
use super::elementwise::broadcast;

/// One operand's term: its labels, with the ellipsis (if any) at `ellipsis` among them.
struct Term {
    labels: Vec<char>,
    ellipsis: Option<usize>,
}

fn term(s: &str) -> Result<Term, String> {
    let mut labels = Vec::new();
    let mut ellipsis = None;
    let mut rest = s;
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("...") {
            if ellipsis.is_some() {
                return Err(format!("the term `{s}` has two ellipses"));
            }
            ellipsis = Some(labels.len());
            rest = &rest[3..];
        } else if c.is_ascii_alphabetic() {
            labels.push(c);
            rest = &rest[1..];
        } else {
            return Err(format!("the term `{s}` holds `{c}`, which is no label"));
        }
    }
    Ok(Term { labels, ellipsis })
}

/// The output shape of `equation` over operands of `shapes`: each label's size (equal, or 1
/// broadcast), the ellipses' dims broadcast together; without `->` the ellipsis dims, then
/// the labels used once, in alphabetical order.
pub fn einsum_shape(equation: &str, shapes: &[&[i64]]) -> Result<Vec<i64>, String> {
    let equation: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (equation.as_str(), None),
    };
    let terms: Vec<Term> = lhs.split(',').map(term).collect::<Result<_, _>>()?;
    if terms.len() != shapes.len() {
        return Err(format!("the equation `{equation}` has {} operands, the node {}", terms.len(), shapes.len()));
    }
    let mut sizes: BTreeMap<char, i64> = BTreeMap::new();
    let mut counts: BTreeMap<char, usize> = BTreeMap::new();
    let mut ellipsis: Vec<i64> = Vec::new();
    for (t, shape) in terms.iter().zip(shapes) {
        let dims_of_ellipsis = shape.len().checked_sub(t.labels.len()).ok_or_else(|| format!("an operand of rank {} has {} labels", shape.len(), t.labels.len()))?;
        if t.ellipsis.is_none() && dims_of_ellipsis != 0 {
            return Err(format!("an operand of rank {} has {} labels and no ellipsis", shape.len(), t.labels.len()));
        }
        let at = t.ellipsis.unwrap_or(t.labels.len());
        ellipsis = broadcast(&ellipsis, &shape[at..at + dims_of_ellipsis])?;
        for (k, &c) in t.labels.iter().enumerate() {
            let d = shape[if k < at { k } else { k + dims_of_ellipsis }];
            *counts.entry(c).or_default() += 1;
            let e = sizes.entry(c).or_insert(d);
            if *e != d {
                if *e == 1 {
                    *e = d;
                } else if d != 1 {
                    return Err(format!("label `{c}` is {} in one operand and {d} in another", *e));
                }
            }
        }
    }
    let out = match rhs {
        Some(r) => term(r)?,
        None => Term { labels: counts.iter().filter(|&(_, &n)| n == 1).map(|(&c, _)| c).collect(), ellipsis: (!ellipsis.is_empty()).then_some(0) },
    };
    let mut shape = Vec::new();
    for (k, c) in out.labels.iter().enumerate() {
        if out.ellipsis == Some(k) {
            shape.extend_from_slice(&ellipsis);
        }
        shape.push(*sizes.get(c).ok_or_else(|| format!("the output label `{c}` is in no operand"))?);
    }
    if out.ellipsis == Some(out.labels.len()) {
        shape.extend_from_slice(&ellipsis);
    }
    Ok(shape)
}

/// The product of the sizes of the labels `equation` sums over (in no output): an Einsum's
/// multiply-adds per output element. `None` where the equation does not parse.
pub fn einsum_contracted(equation: &str, shapes: &[&[i64]]) -> Option<i64> {
    let equation: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = equation.split_once("->")?;
    let out: Vec<char> = term(rhs).ok()?.labels;
    let mut sizes: BTreeMap<char, i64> = BTreeMap::new();
    for (t, shape) in lhs.split(',').map(term).zip(shapes) {
        let t = t.ok()?;
        let extra = shape.len().checked_sub(t.labels.len())?;
        let at = t.ellipsis.unwrap_or(t.labels.len());
        for (k, &c) in t.labels.iter().enumerate() {
            let d = shape[if k < at { k } else { k + extra }];
            let e = sizes.entry(c).or_insert(d);
            *e = (*e).max(d);
        }
    }
    Some(sizes.iter().filter(|(c, _)| !out.contains(c)).map(|(_, &d)| d).product())
}

/// Einsum: the first operand's type, the equation's output dims.
pub(super) fn einsum(cx: &Ctx) -> Outs {
    let equation = cx.attrs().str("equation").ok_or("Einsum has no `equation`")?;
    let shapes: Option<Vec<&[i64]>> = (0..cx.node.inputs.len()).map(|i| cx.shape(i)).collect();
    let shape = match shapes {
        Some(s) => Some(einsum_shape(equation, &s)?),
        None => None,
    };
    one((ty_opt(cx.dtype(0), shape), None))
}

#[cfg(test)]
mod tests {
    use super::einsum_shape;

    #[test]
    fn einsum_names_its_output_dims() {
        assert_eq!(einsum_shape("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]).unwrap(), vec![2, 3, 5]);
        assert_eq!(einsum_shape("ij,jk", &[&[3, 4], &[4, 5]]).unwrap(), vec![3, 5]);
        assert_eq!(einsum_shape("...ii->...i", &[&[7, 2, 3, 3]]).unwrap(), vec![7, 2, 3]);
        assert_eq!(einsum_shape("i,i", &[&[3], &[3]]).unwrap(), Vec::<i64>::new());
        assert_eq!(einsum_shape("ij->ji", &[&[3, 4]]).unwrap(), vec![4, 3]);
        assert!(einsum_shape("ij,jk->ik", &[&[3, 4], &[5, 6]]).is_err());
    }
}
