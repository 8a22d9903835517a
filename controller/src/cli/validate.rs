//! `tessera validate`: static checks of DeviceClasses, claims and claim templates, and of pods
//! that ask with device-plugin resource names.

use std::fmt::Write as _;

use tessera_driver::rules::cel::CelCache;
use tessera_driver::rules::validation::{
    capacity_rounding_warnings, share_classes, validate_claim_spec, validate_device_class,
};

use crate::cli::input::Objects;
use crate::cli::output::printable;
use crate::error::{Error, Result};

/// Checks every object and returns the report text, or [`Error::Findings`] after writing the
/// problems into `report`.
pub fn run(objects: &Objects, driver: &str, report: &mut String) -> Result<()> {
    let cel = CelCache::new();
    let shares = share_classes(&objects.classes);
    let shares: Vec<&str> = shares.iter().map(String::as_str).collect();
    let lookup = |name: &str| {
        objects
            .classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .cloned()
    };
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    for class in &objects.classes {
        problems.extend(validate_device_class(class, driver, &cel));
    }
    for claim in &objects.claims {
        let object = format!(
            "ResourceClaim {}/{}",
            claim.metadata.namespace.as_deref().unwrap_or("default"),
            claim.metadata.name.as_deref().unwrap_or("<unnamed>")
        );
        warnings.extend(capacity_rounding_warnings(&object, &claim.spec, &shares));
        problems.extend(validate_claim_spec(
            &object,
            &claim.spec,
            driver,
            &shares,
            &lookup,
            &cel,
        ));
    }
    for template in &objects.templates {
        let object = format!(
            "ResourceClaimTemplate {}/{}",
            template.metadata.namespace.as_deref().unwrap_or("default"),
            template.metadata.name.as_deref().unwrap_or("<unnamed>")
        );
        warnings.extend(
            capacity_rounding_warnings(&object, &template.spec.spec, &shares)
                .into_iter()
                .map(|w| w.replacen(": spec.devices", ": spec.spec.devices", 1)),
        );
        let errors =
            validate_claim_spec(&object, &template.spec.spec, driver, &shares, &lookup, &cel);
        // Template fields sit one level deeper than a claim's.
        problems.extend(errors.into_iter().map(|e| match e {
            tessera_driver::Error::Invalid {
                object,
                field,
                message,
            } => tessera_driver::Error::Invalid {
                object,
                field: format!("spec.{field}"),
                message,
            },
            other => other,
        }));
    }
    // Pods asking with device-plugin names: what the pod webhook would refuse.
    let (pods, refused) = crate::cli::device_plugin::problems(objects, driver);
    problems.extend(refused);
    let checked = objects.classes.len() + objects.claims.len() + objects.templates.len() + pods;
    // What the API server would refuse comes first; a rule both it and the share checks apply
    // (a CEL expression that does not compile) is listed once.
    let mut lines: Vec<String> = objects.refused.clone();
    for problem in &problems {
        let line = problem.to_string();
        if !objects.refused.iter().any(|r| r.ends_with(&line)) && !lines.contains(&line) {
            lines.push(line);
        }
    }
    // One line per finding, whatever the names in it hold: control characters (escape
    // sequences, bells, line breaks) and format characters (bidi overrides) are written as
    // escapes, as `allocate` writes them.
    for line in &lines {
        let _ = writeln!(report, "error: {}", printable(line, false));
    }
    for warning in &warnings {
        let _ = writeln!(report, "warning: {}", printable(warning, false));
    }
    if !objects.refused.is_empty() {
        let _ = writeln!(
            report,
            "{} problem(s) in {checked} object(s) checked; the API server would refuse {} of them",
            lines.len(),
            objects.refused.len()
        );
        return Err(Error::Malformed(format!(
            "{} problem(s) the API server would refuse the input for",
            objects.refused.len()
        )));
    }
    if lines.is_empty() {
        let _ = writeln!(report, "ok: {checked} object(s) checked, no problems found");
        Ok(())
    } else {
        let _ = writeln!(
            report,
            "{} problem(s) in {checked} object(s) checked",
            lines.len()
        );
        Err(Error::Findings { count: lines.len() })
    }
}
