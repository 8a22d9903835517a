//! Baidu CCE's dialect: `baidu.com/<model>_cgpu: M` for M whole GPUs of the model, and with
//! `_cgpu_memory: N` (GiB) or `_cgpu_memory_percent: P`, and optionally `_cgpu_core: C`, a
//! `GpuShare` over M cards of the model, as the request `baidu`. One model per container; the
//! seed's share rules bind the totals exactly (they divide evenly over the M cards, compute in
//! steps of 5 needs memory, memory xor percent, a share never exceeds a card).

use std::collections::BTreeMap;

use super::claim::{Builder, gpu_share};
use super::request::ContainerAsk;
use crate::error::Result;
use crate::names;
use crate::node::inventory::models;
use crate::rules::share::{COMPUTE_STEP, GIB};

/// Baidu CCE: `baidu.com/<model>_cgpu`, `_cgpu_memory`, `_cgpu_core`, `_cgpu_memory_percent`.
pub const BAIDU_PREFIX: &str = "baidu.com/";

/// Baidu's model names and the Tessera models they are.
pub const BAIDU_MODELS: &[(&str, &str)] = &[
    ("v100_16g", "v100-16g"),
    ("v100_32g", "v100-32g"),
    ("t4_16g", "t4-16g"),
    ("a100_80g", "a100-80g"),
    ("a100_40g", "a100-40g"),
    ("a800_80g", "a800-80g"),
    ("a30_24g", "a30-24g"),
    ("a10_24g", "a10-24g"),
    ("rtx_3090", "rtx-3090"),
    ("rtx_4090", "rtx-4090"),
    ("h800_80g", "h800-80g"),
    ("l20", "l20-48g"),
    ("h20_96g", "h20-96g"),
    ("h20_141g", "h20-141g"),
    ("h20z_141g", "h20z-141g"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BaiduPart {
    Cards,
    Memory,
    Core,
    MemoryPercent,
}

/// `baidu.com/<model>_cgpu...`: the model and which part of the ask.
fn baidu_part(name: &str) -> Option<(&str, BaiduPart)> {
    let rest = name.strip_prefix(BAIDU_PREFIX)?;
    [
        ("_cgpu_memory_percent", BaiduPart::MemoryPercent),
        ("_cgpu_memory", BaiduPart::Memory),
        ("_cgpu_core", BaiduPart::Core),
        ("_cgpu", BaiduPart::Cards),
    ]
    .into_iter()
    .find_map(|(suffix, part)| {
        rest.strip_suffix(suffix)
            .filter(|m| !m.is_empty())
            .map(|m| (m, part))
    })
}

/// Whether `name` is one of this dialect's names.
pub(super) fn is_name(name: &str) -> bool {
    baidu_part(name).is_some()
}

/// The Tessera model of a Baidu model name: the Baidu table first, then any model Tessera
/// knows under the name with `_` read as `-`.
pub fn baidu_model(name: &str) -> Option<&'static models::GpuModel> {
    BAIDU_MODELS
        .iter()
        .find(|(baidu, _)| *baidu == name)
        .and_then(|(_, id)| models::lookup(id))
        .or_else(|| models::lookup(&name.replace('_', "-")))
}

fn model_selector(driver: &str, model: &str) -> String {
    format!(
        "device.attributes[\"{driver}\"].{} == \"{model}\"",
        names::ATTR_MODEL
    )
}

/// The container's Baidu ask, if any, as the request `baidu`: whole GPUs of the model, or a
/// share over its cards.
#[allow(
    clippy::too_many_lines,
    reason = "the dialect's rules, one after another, read best in one place"
)]
pub(super) fn add(b: &mut Builder, ask: &ContainerAsk, driver: &str, object: &str) -> Result<()> {
    let err = |name: &str, message: String| ask.error(object, name, &message);
    let mut baidu: BTreeMap<&str, BTreeMap<BaiduPart, (&str, u64)>> = BTreeMap::new();
    for (name, n) in &ask.resources {
        if let Some((model, part)) = baidu_part(name)
            && *n > 0
        {
            baidu
                .entry(model)
                .or_default()
                .insert(part, (name.as_str(), *n));
        }
    }
    if baidu.len() > 1 {
        let models: Vec<&str> = baidu.keys().copied().collect();
        let first = baidu.values().next().and_then(|p| p.values().next());
        return Err(err(
            first.map_or(BAIDU_PREFIX, |(n, _)| n),
            format!(
                "asks for Baidu models {}: one container asks for one model",
                models.join(" and ")
            ),
        ));
    }
    let Some((model_name, parts)) = baidu.into_iter().next() else {
        return Ok(());
    };
    let any = parts.values().next().map_or(BAIDU_PREFIX, |(n, _)| *n);
    let model = baidu_model(model_name).ok_or_else(|| {
        err(
            any,
            format!(
                "unknown GPU model {model_name:?}: Tessera knows the Baidu models {} and \
                 its own ({})",
                BAIDU_MODELS
                    .iter()
                    .map(|(b, _)| *b)
                    .collect::<Vec<_>>()
                    .join(", "),
                models::known_ids()
            ),
        )
    })?;
    let Some(&(cards_name, m)) = parts.get(&BaiduPart::Cards) else {
        return Err(err(
            any,
            format!(
                "{any} needs {BAIDU_PREFIX}{model_name}_cgpu, the number of cards it spreads over"
            ),
        ));
    };
    let count = ask.cards(object, cards_name, m)?;
    let memory = parts.get(&BaiduPart::Memory).copied();
    let percent = parts.get(&BaiduPart::MemoryPercent).copied();
    let core = parts.get(&BaiduPart::Core).copied();
    let selector = Some(model_selector(driver, model.id));
    if memory.is_none() && percent.is_none() {
        if let Some((core_name, _)) = core {
            return Err(err(
                core_name,
                format!(
                    "{core_name}: compute needs memory: add {BAIDU_PREFIX}{model_name}_cgpu_memory \
                     or _cgpu_memory_percent"
                ),
            ));
        }
        b.request("baidu", "baidu", names::CLASS_GPU, m, selector);
        return Ok(());
    }
    let over = if m > 1 {
        format!(" over {m} cards")
    } else {
        String::new()
    };
    // A total over the M cards, per card: `unit` follows the total, `whole` names the step.
    let per_card = |name: &str, total: u64, unit: &str, whole: &str| {
        if total.is_multiple_of(m) {
            Ok(total / m)
        } else {
            Err(err(
                name,
                format!("{name}: {total}{unit}{over} is not a whole {whole} per card"),
            ))
        }
    };
    if let (Some(_), Some((pct_name, _))) = (memory, percent) {
        return Err(err(
            pct_name,
            format!(
                "{BAIDU_PREFIX}{model_name}_cgpu_memory and _cgpu_memory_percent are \
                 exclusive: set one"
            ),
        ));
    }
    if let Some((mem_name, n)) = memory {
        let per_card = per_card(mem_name, n, " GiB", "number of GiB")?;
        if per_card.saturating_mul(GIB) > model.memory_bytes {
            #[allow(
                clippy::cast_precision_loss,
                reason = "a message: a card's memory in GiB, to one decimal"
            )]
            let card = model.memory_bytes as f64 / GIB as f64;
            return Err(err(
                mem_name,
                format!(
                    "{mem_name}: {per_card} GiB per card is more than a {}'s {card:.1} GiB: \
                     a share never exceeds a card",
                    model.id
                ),
            ));
        }
    }
    if let Some((pct_name, p)) = percent
        && p > 100
    {
        return Err(err(
            pct_name,
            format!("{pct_name}: {p} is outside 1..100 percent of a card"),
        ));
    }
    if let Some((core_name, total)) = core {
        let per_card = per_card(core_name, total, "", "percent")?;
        let step = COMPUTE_STEP.unsigned_abs();
        if per_card > 100 || !per_card.is_multiple_of(step) {
            return Err(err(
                core_name,
                format!("{core_name}: {per_card} per card is not a multiple of {step} in 5..100"),
            ));
        }
    }
    b.request("baidu", "baidu", names::CLASS_SHARED_GPU, m, selector);
    b.share(
        "baidu",
        driver,
        gpu_share(
            memory.map(|(_, n)| n),
            percent.map(|(_, p)| p),
            core.map(|(_, c)| c),
        ),
        count,
    );
    Ok(())
}
