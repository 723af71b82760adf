//! The parallel configuration's vocabulary shared by every stage: the mesh axes and their
//! rank order (placement).

use std::fmt;
use std::str::FromStr;

/// One axis of the device mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshAxis {
    /// Data parallel.
    D,
    /// Pipeline parallel.
    P,
    /// Tensor parallel.
    T,
}

impl MeshAxis {
    /// Position of the axis in `(d, p, t)` triples.
    pub fn index(self) -> usize {
        match self {
            MeshAxis::D => 0,
            MeshAxis::P => 1,
            MeshAxis::T => 2,
        }
    }
}

/// Rank order of the mesh, outermost axis first: the last axis gets consecutive ranks (the
/// fastest, innermost link). SMP's `cluster` = DPT, `spread` = TPD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Placement(pub [MeshAxis; 3]);

impl Placement {
    /// SMP's `cluster`: D outermost, T innermost (tensor groups inside a node).
    pub const CLUSTER: Placement = Placement([MeshAxis::D, MeshAxis::P, MeshAxis::T]);
    /// SMP's `spread`: T outermost, D innermost (data-parallel groups inside a node).
    pub const SPREAD: Placement = Placement([MeshAxis::T, MeshAxis::P, MeshAxis::D]);

    /// Global rank of mesh coordinates (d, p, t) for degrees (dp, pp, tp).
    pub fn rank(&self, coord: [usize; 3], degrees: [usize; 3]) -> usize {
        self.0.iter().fold(0, |r, &a| r * degrees[a.index()] + coord[a.index()])
    }

    /// Rank distance between neighbours along `axis` for degrees (dp, pp, tp).
    pub fn stride(&self, axis: MeshAxis, degrees: [usize; 3]) -> usize {
        let pos = self.0.iter().position(|&a| a == axis).unwrap_or(0);
        self.0[pos + 1..].iter().map(|&a| degrees[a.index()]).product()
    }

    /// Ranks of pipeline rank `p`, data-replica-major then tensor rank (`tp · dp` of them).
    pub fn stage_ranks(&self, p: usize, [dp, pp, tp]: [usize; 3]) -> Vec<usize> {
        (0..dp).flat_map(|d| (0..tp).map(move |t| self.rank([d, p, t], [dp, pp, tp]))).collect()
    }

    /// `DPT`-style text.
    pub fn name(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for a in self.0 {
            write!(f, "{a:?}")?;
        }
        Ok(())
    }
}

impl FromStr for Placement {
    type Err = String;
    /// `cluster`, `spread` or a permutation of D, P, T (any case).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cluster" => return Ok(Placement::CLUSTER),
            "spread" => return Ok(Placement::SPREAD),
            _ => {}
        }
        let axes: Vec<MeshAxis> = s
            .chars()
            .map(|c| match c.to_ascii_uppercase() {
                'D' => Some(MeshAxis::D),
                'P' => Some(MeshAxis::P),
                'T' => Some(MeshAxis::T),
                _ => None,
            })
            .collect::<Option<_>>()
            .unwrap_or_default();
        let perm = axes.len() == 3 && [MeshAxis::D, MeshAxis::P, MeshAxis::T].iter().all(|a| axes.contains(a));
        if perm {
            Ok(Placement([axes[0], axes[1], axes[2]]))
        } else {
            Err(format!("`{s}`: expected cluster, spread or a permutation of D, P, T (e.g. DPT)"))
        }
    }
}
