//! The parameter lists of a PTX module's kernels, read from their `.entry` declarations, so
//! that a launch whose arguments do not match its kernel is an error naming both lists rather
//! than a kernel reading garbage (CUDA itself checks nothing).

use std::fmt;

/// The PTX type class of one kernel parameter, which is all a launch can be checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// `.u32`/`.s32`/`.b32`: `int` or `unsigned`.
    Int32,
    /// `.u64`/`.s64`/`.b64`: a pointer, `long long` or `unsigned long long`.
    Int64,
    /// `.f32`: `float`.
    Float32,
    /// `.f64`: `double`.
    Float64,
    /// Anything else (a byte array for a struct, a 16-bit or 8-bit value).
    Other,
}

impl fmt::Display for ParamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ParamKind::Int32 => "32-bit int",
            ParamKind::Int64 => "64-bit int or pointer",
            ParamKind::Float32 => "float",
            ParamKind::Float64 => "double",
            ParamKind::Other => "other",
        })
    }
}

/// The parameters of kernel `name` in `ptx`, in order; `None` when the module declares no
/// such entry.
pub fn entry_params(ptx: &str, name: &str) -> Option<Vec<ParamKind>> {
    let start = ptx.find(&format!(".entry {name}("))? + ".entry (".len() + name.len();
    let list = &ptx[start..start + ptx[start..].find(')')?];
    Some(
        list.split(',')
            .filter(|param| !param.trim().is_empty())
            .map(param_kind)
            .collect(),
    )
}

/// The kind of one declaration such as `.param .u64 sgd_step_param_0`.
fn param_kind(declaration: &str) -> ParamKind {
    let mut words = declaration.split_whitespace();
    if words.next() != Some(".param") {
        return ParamKind::Other;
    }
    match words.next() {
        Some(".u32" | ".s32" | ".b32") => ParamKind::Int32,
        Some(".u64" | ".s64" | ".b64") => ParamKind::Int64,
        Some(".f32") => ParamKind::Float32,
        Some(".f64") => ParamKind::Float64,
        _ => ParamKind::Other,
    }
}

/// A list of kinds as `(float, 32-bit int)`, for errors.
pub fn describe(kinds: &[ParamKind]) -> String {
    let names: Vec<String> = kinds.iter().map(ToString::to_string).collect();
    format!("({})", names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = "
.visible .entry divide_in_place(
\t.param .u64 divide_in_place_param_0,
\t.param .u64 divide_in_place_param_1,
\t.param .f32 divide_in_place_param_2
)
{
\tld.param.u64 %rd1, [divide_in_place_param_0];
}
.visible .entry nothing(
)
{
}
.visible .entry mixed(
\t.param .u32 mixed_param_0,
\t.param .f64 mixed_param_1,
\t.param .align 4 .b8 mixed_param_2[8],
\t.param .s32 mixed_param_3
)
";

    #[test]
    fn reads_each_entrys_parameters_in_order() {
        use ParamKind::*;
        assert_eq!(
            entry_params(PTX, "divide_in_place"),
            Some(vec![Int64, Int64, Float32])
        );
        assert_eq!(entry_params(PTX, "nothing"), Some(vec![]));
        assert_eq!(
            entry_params(PTX, "mixed"),
            Some(vec![Int32, Float64, Other, Int32])
        );
    }

    #[test]
    fn a_missing_entry_or_a_prefix_of_a_name_is_none() {
        assert_eq!(entry_params(PTX, "divide"), None);
        assert_eq!(entry_params(PTX, "absent"), None);
    }

    #[test]
    fn describes_a_list_for_errors() {
        assert_eq!(
            describe(&[ParamKind::Int64, ParamKind::Float32]),
            "(64-bit int or pointer, float)"
        );
    }
}
