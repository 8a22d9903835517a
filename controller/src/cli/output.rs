//! Printing allocation outcomes as JSON, YAML or a table.

use std::fmt::Write as _;

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1 as res;
use tessera_driver::Quantity;
use tessera_driver::apiversion::{ApiVersion, encode_allocation, to_kubectl_yaml};
use tessera_driver::rules::config::{self, TesseraConfig};
use tessera_driver::tools::batch::ClaimOutcome;

use crate::cli::OutputFormat;
use crate::cli::allocate::Answer;
use crate::cli::input::Objects;
use crate::error::{Error, Result};

#[derive(serde::Serialize)]
struct Report<'a> {
    results: &'a [ClaimOutcome],
    /// The objects left out, one line each (absent when there are none).
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    errors: &'a [String],
}

/// Writes the answer in the chosen format: results, then the errors of what was left out
/// (`-o claims` writes objects only; its errors are the caller's to print elsewhere).
pub fn write(
    answer: &Answer,
    objects: &Objects,
    format: OutputFormat,
    out: &mut String,
) -> Result<()> {
    let outcomes = answer.outcomes.as_slice();
    let report = Report {
        results: outcomes,
        errors: &answer.errors,
    };
    match format {
        OutputFormat::Json => {
            let text =
                serde_json::to_string_pretty(&report).map_err(|e| Error::Output(e.to_string()))?;
            out.push_str(&text);
            out.push('\n');
        }
        OutputFormat::Yaml => {
            let value = serde_json::to_value(&report).map_err(|e| Error::Output(e.to_string()))?;
            out.push_str(&serde_yaml::to_string(&value).map_err(|e| Error::Output(e.to_string()))?);
        }
        OutputFormat::Table => {
            table(outcomes, out);
            for error in &answer.errors {
                let _ = writeln!(out, "error: {}", printable(error, false));
            }
        }
        OutputFormat::Claims => claims(answer, objects, out)?,
    }
    Ok(())
}

/// The input's ResourceClaims as YAML documents, in input order, each in its own API version
/// and as the input wrote it, with `status.allocation` filled in where it was allocated now.
/// Claims Tessera refused are left out; a claim the device-plugin rewrite made is written in
/// v1.
fn claims(answer: &Answer, objects: &Objects, out: &mut String) -> Result<()> {
    let allocated: BTreeMap<(&str, &str), &res::AllocationResult> = answer
        .outcomes
        .iter()
        .filter_map(|o| {
            Some((
                (o.namespace.as_str(), o.name.as_str()),
                o.allocation.as_ref()?,
            ))
        })
        .collect();
    let mut documents = Vec::new();
    for claim in &objects.claims {
        let key = (
            claim
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned()),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        if answer.refused_claims.contains(&key) {
            continue;
        }
        let mut document = match objects.claim_documents.get(&key) {
            Some(document) => document.clone(),
            None => serde_json::to_value(claim).map_err(|e| Error::Output(e.to_string()))?,
        };
        if let Some(allocation) = allocated.get(&(key.0.as_str(), key.1.as_str())) {
            let version = document["apiVersion"]
                .as_str()
                .and_then(ApiVersion::from_api_version)
                .unwrap_or(ApiVersion::V1);
            let object = format!("ResourceClaim {}/{}", key.0, key.1);
            let encoded = encode_allocation(allocation, version, &object)?;
            let Some(map) = document.as_object_mut() else {
                return Err(Error::Output(format!("{object}: not an object")));
            };
            let status = map
                .entry("status")
                .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
            if !status.is_object() {
                *status = serde_json::Value::Object(serde_json::Map::new());
            }
            if let Some(status) = status.as_object_mut() {
                status.insert("allocation".to_owned(), encoded);
            }
        }
        documents.push(document);
    }
    if !documents.is_empty() {
        out.push_str(&to_kubectl_yaml(&serde_json::Value::Array(documents)));
    }
    Ok(())
}

/// One line per allocated device: `request -> pool/device (share)`.
pub fn device_lines(allocation: &res::AllocationResult) -> Vec<String> {
    let mut shares = std::collections::BTreeMap::new();
    for cfg in allocation
        .devices
        .iter()
        .flat_map(|d| d.config.iter().flatten())
    {
        if let Some(opaque) = &cfg.opaque
            && let Ok(TesseraConfig::AllocatedShares(record)) =
                config::decode(&opaque.parameters.0, "config")
        {
            for d in record.devices {
                let guaranteed = (d.guaranteed_memory.is_some() || d.guaranteed_compute.is_some())
                    .then(|| (d.guaranteed_memory(), d.guaranteed_compute()));
                shares.insert(
                    (d.pool.clone(), d.device.clone()),
                    (d.memory, d.compute, guaranteed),
                );
            }
        }
    }
    allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| {
            let share = shares.get(&(r.pool.clone(), r.device.clone())).map(
                |(memory, compute, guaranteed)| {
                    let over = guaranteed.map_or_else(String::new, |(m, c)| {
                        format!(", guaranteed {m} and {c}% compute, the rest over-committed")
                    });
                    if *compute > 0 {
                        format!(" ({memory}, {compute}% compute{over})")
                    } else {
                        format!(" ({memory}{over})")
                    }
                },
            );
            let consumed = share.is_none().then(|| consumed_text(r)).flatten();
            format!(
                "{} -> {}/{}{}",
                r.request,
                r.pool,
                r.device,
                share.or(consumed).unwrap_or_default()
            )
        })
        .collect()
}

fn consumed_text(r: &res::DeviceRequestAllocationResult) -> Option<String> {
    let consumed = r.consumed_capacity.as_ref().filter(|c| !c.is_empty())?;
    let parts: Vec<String> = consumed
        .iter()
        .map(|(k, v)| {
            format!(
                "{k}={}",
                Quantity::from_k8s(v).map_or_else(|_| v.0.clone(), |q| q.to_string())
            )
        })
        .collect();
    Some(format!(" ({})", parts.join(", ")))
}

/// `text` with every control character (`\u{1b}`), every format character (Unicode category
/// Cf: bidi controls such as `\u{202e}`, zero-width joiners) and line separator (`\u{2028}`)
/// written as an escape ([`tessera_kubeapi::text::is_hidden`]), so that names
/// and reasons taken from input can never drive the terminal nor read other than they are;
/// `keep_newlines` keeps line breaks of multi-line messages.
pub fn printable(text: &str, keep_newlines: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let hidden = tessera_kubeapi::text::is_hidden(c);
        if hidden && !(keep_newlines && c == '\n') {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

fn table(outcomes: &[ClaimOutcome], out: &mut String) {
    let mut rows = vec![[
        "CLAIM".to_owned(),
        "STATUS".to_owned(),
        "NODE".to_owned(),
        "DEVICES / REASON".to_owned(),
    ]];
    for o in outcomes {
        let claim = format!("{}/{}", o.namespace, o.name);
        match &o.allocation {
            Some(allocation) => {
                let lines = device_lines(allocation);
                let node = o.node.clone().unwrap_or_else(|| "-".to_owned());
                for (i, line) in lines.iter().enumerate() {
                    if i == 0 {
                        rows.push([
                            claim.clone(),
                            "allocated".to_owned(),
                            node.clone(),
                            line.clone(),
                        ]);
                    } else {
                        rows.push([String::new(), String::new(), String::new(), line.clone()]);
                    }
                }
                if lines.is_empty() {
                    rows.push([
                        claim,
                        "allocated".to_owned(),
                        node,
                        "(no devices)".to_owned(),
                    ]);
                }
            }
            None => rows.push([
                claim,
                "pending".to_owned(),
                "-".to_owned(),
                o.reason.clone().unwrap_or_default(),
            ]),
        }
    }
    let rows: Vec<[String; 4]> = rows
        .into_iter()
        .map(|r| r.map(|cell| printable(&cell, false)))
        .collect();
    let widths: Vec<usize> = (0..3)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let _ = writeln!(
            out,
            "{:w0$}  {:w1$}  {:w2$}  {}",
            row[0],
            row[1],
            row[2],
            row[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(printable("a\u{1b}[31mb", false), "a\\u{1b}[31mb");
        assert_eq!(printable("one\ntwo\r", true), "one\ntwo\\u{d}");
    }

    #[test]
    fn bidi_and_other_format_characters_are_escaped() {
        // A right-to-left override would show `gpu-\u{202e}txt.exe` as `gpu-exe.txt`.
        assert_eq!(
            printable("gpu-\u{202e}txt.exe", false),
            "gpu-\\u{202e}txt.exe"
        );
        assert_eq!(
            printable("a\u{2066}b\u{2069}\u{200b}\u{200d}\u{feff}\u{ad}", true),
            "a\\u{2066}b\\u{2069}\\u{200b}\\u{200d}\\u{feff}\\u{ad}"
        );
        // Letters of right-to-left scripts are text, not format characters.
        assert_eq!(printable("שלום", false), "שלום");
    }
}
