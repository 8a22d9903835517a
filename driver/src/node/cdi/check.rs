//! The rules every value must pass before it is written into a spec. Each input is typed and
//! was validated once already (by `crate::rules::share` or discovery); these checks make sure that
//! nothing malformed (a relative path, a stray character, an out-of-range number) can reach a
//! container, whoever built the input.

use crate::error::{Error, Result};

pub(super) fn err(claim: &str, message: impl Into<String>) -> Error {
    Error::Cdi {
        claim: claim.to_owned(),
        message: message.into(),
    }
}

fn alnum_ends(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// A name of `max` characters at most, from `allowed`, starting and ending alphanumeric.
fn name(
    claim: &str,
    field: &str,
    value: &str,
    max: usize,
    allowed: impl Fn(char) -> bool,
    chars: &str,
) -> Result<()> {
    if value.is_empty() || value.len() > max || !alnum_ends(value) || !value.chars().all(allowed) {
        return Err(err(
            claim,
            format!(
                "{field} {value:?} must be 1 to {max} characters of {chars}, starting and ending \
                 with a letter or digit"
            ),
        ));
    }
    Ok(())
}

/// A claim UID: Kubernetes writes a UUID; letters, digits and dashes are accepted.
pub(super) fn uid(claim: &str, value: &str) -> Result<()> {
    name(
        claim,
        "uid",
        value,
        63,
        |c| c.is_ascii_alphanumeric() || c == '-',
        "[A-Za-z0-9-]",
    )
}

/// A namespace: a DNS label.
pub(super) fn namespace(claim: &str, value: &str) -> Result<()> {
    name(
        claim,
        "namespace",
        value,
        63,
        |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-',
        "[a-z0-9-]",
    )
}

/// An object name: a DNS subdomain.
pub(super) fn object_name(claim: &str, value: &str) -> Result<()> {
    name(
        claim,
        "name",
        value,
        253,
        |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.',
        "[a-z0-9.-]",
    )
}

/// A request name, `request` or `request/subrequest`, each a DNS label.
pub(super) fn request(claim: &str, field: &str, value: &str) -> Result<()> {
    let parts: Vec<&str> = value.split('/').collect();
    if parts.len() > 2 {
        return Err(err(
            claim,
            format!("{field} {value:?} must be a request or request/subrequest"),
        ));
    }
    for part in parts {
        name(
            claim,
            field,
            part,
            63,
            |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-',
            "[a-z0-9-]",
        )?;
    }
    Ok(())
}

/// A pool name: DNS subdomains separated by `/`.
pub(super) fn pool(claim: &str, field: &str, value: &str) -> Result<()> {
    if value.len() > 253 {
        return Err(err(
            claim,
            format!("{field} {value:?} is longer than 253 characters"),
        ));
    }
    for part in value.split('/') {
        name(
            claim,
            field,
            part,
            253,
            |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.',
            "[a-z0-9.-]",
        )?;
    }
    Ok(())
}

/// A device name as Tessera publishes it (`gpu-0`, `gpu-0-mig-1g.10gb-0`); it becomes part of
/// a CDI device name, whose charset it must fit.
pub(super) fn device(claim: &str, field: &str, value: &str) -> Result<()> {
    name(
        claim,
        field,
        value,
        63,
        |c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.',
        "[a-z0-9.-]",
    )
}

/// A GPU (`GPU-…`) or MIG (`MIG-…`) UUID as NVML reports it: the prefix, then hex digits and
/// dashes.
pub(super) fn nvidia_uuid(claim: &str, field: &str, prefix: &str, value: &str) -> Result<()> {
    let rest = value.strip_prefix(prefix).unwrap_or("");
    if rest.is_empty()
        || value.len() > 64
        || !rest.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
    {
        return Err(err(
            claim,
            format!(
                "{field} {value:?} must be {prefix} followed by hex digits and dashes \
                 (at most 64 characters)"
            ),
        ));
    }
    Ok(())
}

/// A host path from the node's configuration: absolute, normalised (no `.`, `..` or empty
/// segments, no trailing slash), not `/` itself, and only letters, digits, `_`, `-`, `.`, `+`
/// and `/`, so it can never smuggle an option or a second value into a mount or variable.
pub(super) fn host_path(claim: &str, field: &str, value: &str) -> Result<()> {
    let bad = |rule: &str| err(claim, format!("{field} {value:?} {rule}"));
    if !value.starts_with('/') {
        return Err(bad("must be an absolute path"));
    }
    if value == "/" || value.len() > 1024 {
        return Err(bad("must be a path below / of at most 1024 characters"));
    }
    if !value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '_' | '-' | '.' | '+'))
    {
        return Err(bad("may contain only letters, digits and _ - . + /"));
    }
    if value[1..]
        .split('/')
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(bad(
            "must be normalised: no empty, . or .. segments and no trailing /",
        ));
    }
    Ok(())
}
