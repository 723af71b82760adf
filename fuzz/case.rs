//! One fuzzing input: the files a user hands a tool together (a model and its external data,
//! a token file and its sidecar, a checkpoint's manifest and shards). On disk a case of one
//! file under the target's default name is that file's bytes as they are; any other case is
//! an archive:
//!
//! ```text
//! #smp-fuzz case v1
//! == NAME LEN
//! <LEN bytes>
//! == NAME LEN
//! ...
//! ```

/// The first line of an archived case.
pub const MAGIC: &[u8] = b"#smp-fuzz case v1\n";

/// The bytes of one file, shared between a corpus entry and the inputs mutated from it.
pub type Bytes = std::sync::Arc<[u8]>;

/// The files of one input, by relative path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Case {
    /// (relative path, bytes), in order.
    pub files: Vec<(String, Bytes)>,
}

impl Case {
    /// A case of one file.
    pub fn single(name: &str, bytes: Vec<u8>) -> Case {
        Case { files: vec![(name.to_string(), bytes.into())] }
    }

    /// Reads a case from its on-disk form; bytes without [`MAGIC`] are one file named
    /// `default_name`.
    pub fn decode(bytes: &[u8], default_name: &str) -> Result<Case, String> {
        let Some(mut rest) = bytes.strip_prefix(MAGIC) else {
            return Ok(Case::single(default_name, bytes.to_vec()));
        };
        let mut files = Vec::new();
        while !rest.is_empty() {
            let line_end = rest.iter().position(|&b| b == b'\n').ok_or("an entry line has no end")?;
            let line = std::str::from_utf8(&rest[..line_end]).map_err(|_| "an entry line is not UTF-8")?;
            let spec = line.strip_prefix("== ").ok_or_else(|| format!("`{line}` is not `== NAME LEN`"))?;
            let (name, len) = spec.rsplit_once(' ').ok_or_else(|| format!("`{line}` is not `== NAME LEN`"))?;
            let len: usize = len.parse().map_err(|_| format!("`{line}`: bad length"))?;
            check_name(name)?;
            rest = &rest[line_end + 1..];
            let data = rest.get(..len).ok_or_else(|| format!("entry `{name}` is cut short"))?;
            files.push((name.to_string(), data.into()));
            rest = &rest[len..];
        }
        Ok(Case { files })
    }

    /// The on-disk form: the bare bytes when the case is one file named `default_name`.
    #[allow(dead_code)] // the fuzzer encodes into a reused buffer
    pub fn encode(&self, default_name: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len() + 64);
        self.encode_into(default_name, &mut out);
        out
    }

    /// [`Case::encode`] appended to `out`.
    pub fn encode_into(&self, default_name: &str, out: &mut Vec<u8>) {
        if let [(name, bytes)] = self.files.as_slice()
            && name == default_name
            && !bytes.starts_with(MAGIC)
        {
            out.extend_from_slice(bytes);
            return;
        }
        out.extend_from_slice(MAGIC);
        for (name, bytes) in &self.files {
            out.extend_from_slice(format!("== {name} {}\n", bytes.len()).as_bytes());
            out.extend_from_slice(bytes);
        }
    }

    /// A case stored at `path`: a file (bare, or an archive) or a directory (one case of the
    /// files under it). `None` if unreadable.
    pub fn read(path: &std::path::Path, default_name: &str) -> Option<Case> {
        if path.is_dir() {
            let mut files = Vec::new();
            collect(path, path, &mut files);
            files.sort();
            return (!files.is_empty()).then_some(Case { files });
        }
        let bytes = std::fs::read(path).ok()?;
        Case::decode(&bytes, default_name).ok()
    }

    /// Total bytes of the files.
    pub fn len(&self) -> usize {
        self.files.iter().map(|(_, b)| b.len()).sum()
    }

    /// The bytes of file `name`, if the case has it.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.files.iter().find(|(n, _)| n == name).map(|(_, b)| &b[..])
    }

    /// Writes the files under `dir`, which then holds exactly them. `last` is what the
    /// previous call for `dir` wrote: files it holds unchanged are not written again.
    pub fn write_to(&self, dir: &std::path::Path, last: &mut Vec<(String, Bytes)>) -> Result<(), String> {
        let io = |p: &std::path::Path, e: std::io::Error| format!("{}: {e}", p.display());
        // on an error `last` stays empty, and the next call starts from an empty directory
        let last_written = std::mem::take(last);
        let last_ref = &last_written;
        if last_ref.is_empty() && dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        for (name, _) in last_ref.iter().filter(|(n, _)| self.get(n).is_none()) {
            let _ = std::fs::remove_file(dir.join(name));
        }
        for (name, bytes) in &self.files {
            check_name(name)?;
            if last_ref.iter().any(|(n, b)| n == name && (std::sync::Arc::ptr_eq(b, bytes) || b == bytes)) {
                continue;
            }
            let path = dir.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
            }
            // a directory left by an earlier case's `NAME/…` where this case has a file
            if path.is_dir() {
                std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
            }
            std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
        }
        *last = self.files.clone();
        Ok(())
    }
}

fn collect(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<(String, Bytes)>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(root, &p, out);
        } else if let (Ok(rel), Ok(bytes)) = (p.strip_prefix(root), std::fs::read(&p)) {
            out.push((rel.to_string_lossy().into_owned(), bytes.into()));
        }
    }
}

/// A case's file names stay inside its directory.
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && !name.starts_with('/')
        && !name.contains('\n')
        && name.split('/').all(|part| !part.is_empty() && part != "." && part != "..");
    if ok { Ok(()) } else { Err(format!("case file name `{name}` leaves the case's directory")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_round_trip_and_single_files_stay_bare() {
        let one = Case::single("plan.json", b"{}".to_vec());
        assert_eq!(one.encode("plan.json"), b"{}");
        assert_eq!(Case::decode(b"{}", "plan.json").unwrap(), one);
        let two = Case { files: vec![("a.bin".into(), vec![0u8, 10, 255].into()), ("a.bin.json".into(), b"== x 1\n".to_vec().into())] };
        assert_eq!(Case::decode(&two.encode("x"), "x").unwrap(), two);
        let escaping = Case::single("../x", vec![]);
        assert!(Case::decode(&escaping.encode("y"), "y").is_err());
    }
}
