//! Mixture of experts: MixtureOfExperts (the fused routed experts).

use super::context::{Ctx, Outs, one, ty_opt};
use crate::ir::DType;

/// `MixtureOfExperts(x [N, H], weights [N, k], indices [N, k], gate_up [E, 2I, H], down
/// [E, H, I], gate_up_bias [E, 2I]?, down_bias [E, H]?)` → `[N, H]` of x's type; the operands
/// must agree.
pub(super) fn mixture_of_experts(cx: &Ctx) -> Outs {
    let shapes: Option<Vec<&[i64]>> = (0..5).map(|i| cx.shape(i)).collect();
    let Some(s) = shapes else { return one((ty_opt(cx.dtype(0), None), None)) };
    let (x, w, idx, gu, down) = (s[0], s[1], s[2], s[3], s[4]);
    let experts = cx.attrs().int("experts", 0);
    let fits = x.len() == 2
        && w.len() == 2
        && w == idx
        && w[0] == x[0]
        && gu.len() == 3
        && down.len() == 3
        && gu[0] == experts
        && down[0] == experts
        && gu[2] == x[1]
        && down[1] == x[1]
        && gu[1] == 2 * down[2];
    if !fits {
        return Err(format!(
            "operands x {x:?}, weights {w:?}, indices {idx:?}, gate_up {gu:?}, down {down:?} are not [N, H], [N, k], [N, k], [{experts}, 2I, H], [{experts}, H, I]"
        ));
    }
    let biases_fit = match (cx.input(5), cx.input(6)) {
        (None, None) => true,
        (Some(_), Some(_)) => cx.shape(5) == Some(&[experts, gu[1]][..]) && cx.shape(6) == Some(&[experts, x[1]][..]),
        _ => false,
    };
    if !biases_fit {
        let (gb, db) = (cx.shape(5), cx.shape(6));
        {
            return Err(format!(
                "expert biases gate_up_bias {gb:?} and down_bias {db:?} are not [{experts}, {}] and [{experts}, {}] (both or neither)",
                gu[1], x[1]
            ));
        }
    }
    if cx.dtype(2).is_some_and(|d| d != DType::I64) {
        return Err("the expert indices must be int64".into());
    }
    one((ty_opt(cx.dtype(0), Some(x.to_vec())), None))
}
