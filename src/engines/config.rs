//! What the engines' writers and readers hand back, and the command-line words they share:
//! shell-style splitting of argument lists and the launchers' node and process counts.

use std::path::PathBuf;

use crate::solve::{PlanOptions, Source};

/// One file of an engine configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct EmittedFile {
    /// File name (written into the output directory).
    pub name: String,
    /// Its text.
    pub text: String,
}

/// An engine configuration written from a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Written {
    /// The files.
    pub files: Vec<EmittedFile>,
    /// The launch line that runs them.
    pub launch: String,
    /// What the user has to supply that the plan does not decide (data, tokenizer, the model
    /// definition), one line each.
    pub notes: Vec<String>,
}

/// A setting of an engine configuration that the planner read but cannot price, and what it
/// priced instead.
#[derive(Clone, Debug, PartialEq)]
pub struct Unpriced {
    /// The setting as written (`--recompute-granularity selective`).
    pub setting: String,
    /// What the planner prices in its place, and why.
    pub why: String,
}

/// An engine configuration read into the planner's request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    /// The request: every setting the configuration fixes, each with its source.
    pub options: PlanOptions,
    /// Settings read but not priced, named.
    pub unpriced: Vec<Unpriced>,
    /// Settings read that do not affect a plan (paths, learning rates, logging).
    pub no_effect: Vec<String>,
}

/// Where a configuration came from, for sources and messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Origin {
    /// The file, or a description of an argument list (`Megatron-LM arguments`).
    pub what: PathBuf,
}

impl Origin {
    /// The source of `key` = `value` in this configuration.
    pub fn source(&self, key: &str, value: impl ToString) -> Source {
        Source::Config { file: self.what.clone(), key: key.to_string(), value: value.to_string() }
    }

    /// The configuration as named in messages.
    pub fn name(&self) -> String {
        self.what.display().to_string()
    }
}

/// Splits a command line as a POSIX shell would for plain words: whitespace separates,
/// single and double quotes group, a backslash escapes the next character (a backslash before
/// a newline joins lines), `#` starts a comment at the start of a word.
pub fn split_words(text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('\n') => {}
                Some(n) => {
                    cur.push(n);
                    in_word = true;
                }
                None => return Err("a trailing backslash".into()),
            },
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(n) => cur.push(n),
                        None => return Err("an unclosed single quote".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(n @ ('"' | '\\' | '$' | '`')) => cur.push(n),
                            Some('\n') => {}
                            Some(n) => {
                                cur.push('\\');
                                cur.push(n);
                            }
                            None => return Err("an unclosed double quote".into()),
                        },
                        Some(n) => cur.push(n),
                        None => return Err("an unclosed double quote".into()),
                    }
                }
            }
            '#' if !in_word => {
                for n in chars.by_ref() {
                    if n == '\n' {
                        break;
                    }
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// Quotes a word for a shell when it needs it.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c)) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// Node and process counts of a launcher line (`torchrun --nnodes 2 --nproc-per-node 8`,
/// `deepspeed --num_nodes 2 --num_gpus 8`), where given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Launcher {
    /// Nodes.
    pub nodes: Option<usize>,
    /// Processes (GPUs) per node.
    pub per_node: Option<usize>,
}

impl Launcher {
    /// Reads the counts from the words of a launch line; the words after the training script
    /// are its own arguments and are returned apart.
    pub fn read(words: &[String]) -> Result<(Launcher, Vec<String>), String> {
        let mut l = Launcher::default();
        let mut i = 0;
        let value = |i: usize, w: &str| -> Result<(String, usize), String> {
            match w.split_once('=') {
                Some((_, v)) => Ok((v.to_string(), i + 1)),
                None => words.get(i + 1).cloned().map(|v| (v, i + 2)).ok_or_else(|| format!("`{w}` needs a value")),
            }
        };
        let count = |v: &str, w: &str| v.parse::<usize>().map_err(|_| format!("`{w} {v}`: expected a count"));
        while i < words.len() {
            let w = words[i].as_str();
            let flag = w.split('=').next().unwrap_or(w).replace('_', "-");
            match flag.as_str() {
                "--nnodes" | "--num-nodes" => {
                    let (v, next) = value(i, w)?;
                    // torchrun's elastic form MIN:MAX: the run starts on MAX nodes at most
                    let v = v.rsplit(':').next().unwrap_or(&v).to_string();
                    l.nodes = Some(count(&v, w)?);
                    i = next;
                }
                "--nproc-per-node" | "--num-gpus" => {
                    let (v, next) = value(i, w)?;
                    l.per_node = Some(count(&v, w)?);
                    i = next;
                }
                _ if !w.starts_with('-') && (w.ends_with(".py") || w == "-m") => break,
                "-m" => break,
                _ => i += 1,
            }
        }
        // the script (or `-m module`) and what follows are the training program's
        let rest: Vec<String> = match words.get(i).map(String::as_str) {
            Some("-m") => words.get(i + 2..).map(<[String]>::to_vec).unwrap_or_default(),
            Some(_) => words[i + 1..].to_vec(),
            None => Vec::new(),
        };
        Ok((l, rest))
    }

    /// Devices in all, when both counts are known (one node when only the per-node count is).
    pub fn devices(&self) -> Option<usize> {
        self.per_node.map(|g| g * self.nodes.unwrap_or(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_split_as_a_shell_splits_them() {
        let w = split_words("torchrun --nnodes 2 \\\n  'a b' \"c \\\"d\\\"\" e#f # comment\n--g").unwrap();
        assert_eq!(w, ["torchrun", "--nnodes", "2", "a b", "c \"d\"", "e#f", "--g"]);
        assert!(split_words("'open").is_err());
        assert_eq!(shell_quote("Et*7|t*8"), "'Et*7|t*8'");
        assert_eq!(shell_quote("--bf16"), "--bf16");
    }

    #[test]
    fn launchers_give_nodes_and_processes() {
        let w = split_words("torchrun --nnodes=4 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8").unwrap();
        let (l, rest) = Launcher::read(&w).unwrap();
        assert_eq!((l.nodes, l.per_node, l.devices()), (Some(4), Some(8), Some(32)));
        assert_eq!(rest, ["--tensor-model-parallel-size", "8"]);
        let w = split_words("deepspeed --num_nodes 2 --num_gpus 8 train.py --deepspeed_config ds.json").unwrap();
        assert_eq!(Launcher::read(&w).unwrap().0.devices(), Some(16));
        let w = split_words("torchrun --nnodes 1:2 --nproc_per_node 4 -m torchtitan.train --module llama3").unwrap();
        let (l, rest) = Launcher::read(&w).unwrap();
        assert_eq!(l.devices(), Some(8));
        assert_eq!(rest, ["--module", "llama3"]);
    }
}
