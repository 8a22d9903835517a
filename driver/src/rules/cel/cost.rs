//! A static worst-case cost estimate of a selector, computed once at compile time.
//!
//! The cel crate has no runtime cost limit, so the bound is enforced before an expression is
//! ever evaluated: see the module documentation of [`crate::rules::cel`] for the method.

use cel::common::ast::{EntryExpr, Expr, IdedExpr, LiteralValue};

/// Upstream's `CELSelectorExpressionMaxCost`: the most a selector may cost, per device.
pub const MAX_COST: u64 = 1_000_000;

/// The deepest expression tree accepted: bounds the recursion of estimation and evaluation.
pub const MAX_DEPTH: usize = 64;

/// Upper bounds on what the `device` variable holds (`ResourceSliceMaxAttributesAndCapacities
/// PerDevice`, `DeviceAttributeMaxValueLength`, domain and id lengths).
const MAX_ENTRIES: u64 = 32;
const MAX_VALUE_LEN: u64 = 64;
const MAX_DOMAIN_LEN: u64 = 63;
const MAX_ID_LEN: u64 = 32;
const MAX_DRIVER_LEN: u64 = 63;

/// Where in the `device` variable a value comes from, for exact sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Device,
    Attributes,
    AttributeDomain,
    Capacity,
    CapacityDomain,
    Other,
}

/// The estimate for one node: the cost of evaluating it once, and the shape of its value.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Estimate {
    /// Worst-case cost of evaluating the node once.
    pub(crate) cost: u64,
    /// Most characters (string, bytes) or entries (list, map) of the value; 0 for scalars.
    size: u64,
    /// Most weight (see [`Estimate::weight`]) of any one entry of the value.
    elem: u64,
    path: Path,
}

impl Estimate {
    const fn scalar(cost: u64) -> Self {
        Self {
            cost,
            size: 0,
            elem: 0,
            path: Path::Other,
        }
    }

    const fn sized(cost: u64, size: u64, elem: u64) -> Self {
        Self {
            cost,
            size,
            elem,
            path: Path::Other,
        }
    }

    /// A bound on everything the value holds, nested content included.
    fn weight(&self) -> u64 {
        self.size.max(1).saturating_mul(self.elem.max(1))
    }

    /// The shape of one entry of this value (conservatively: as heavy as any entry).
    fn entry(&self) -> Self {
        Self::sized(0, self.elem, self.elem)
    }
}

/// Charged per character copied or scanned, as cel-go does (0.1 per character).
fn per_chars(n: u64) -> u64 {
    n.div_ceil(10)
}

struct Estimator {
    scopes: Vec<(String, Estimate)>,
}

/// Estimates `expr`, or explains why it is refused (too deep).
pub(crate) fn estimate(expr: &IdedExpr) -> Result<Estimate, String> {
    let mut e = Estimator { scopes: Vec::new() };
    e.expr(expr, 0)
}

fn device() -> Estimate {
    Estimate {
        cost: 1,
        size: 4,
        elem: MAX_ENTRIES * MAX_ENTRIES * MAX_VALUE_LEN * MAX_VALUE_LEN,
        path: Path::Device,
    }
}

/// Selecting `field` (or indexing with it) on a value from `path`.
fn select(operand: &Estimate, field: Option<&str>) -> Estimate {
    let attr_value = Estimate::sized(0, MAX_VALUE_LEN, MAX_VALUE_LEN);
    let at = |path, size, elem| Estimate {
        cost: 0,
        size,
        elem,
        path,
    };
    match (operand.path, field) {
        (Path::Device, Some("driver")) => Estimate::sized(0, MAX_DRIVER_LEN, 0),
        (Path::Device, Some("attributes")) => at(
            Path::Attributes,
            MAX_ENTRIES,
            MAX_ENTRIES * attr_value.weight(),
        ),
        (Path::Device, Some("capacity")) => at(Path::Capacity, MAX_ENTRIES, MAX_ENTRIES),
        (Path::Attributes, _) => at(Path::AttributeDomain, MAX_ENTRIES, attr_value.weight()),
        (Path::AttributeDomain, _) => attr_value,
        (Path::Capacity, _) => at(Path::CapacityDomain, MAX_ENTRIES, 1),
        (Path::Device, Some(_)) | (Path::CapacityDomain, _) => Estimate::scalar(0),
        _ => operand.entry(),
    }
}

impl Estimator {
    fn lookup(&self, name: &str) -> Option<Estimate> {
        self.scopes
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, e)| *e)
    }

    #[allow(
        clippy::too_many_lines,
        reason = "one arm per node kind reads best together"
    )]
    fn expr(&mut self, expr: &IdedExpr, depth: usize) -> Result<Estimate, String> {
        if depth > MAX_DEPTH {
            return Err(format!("expression nests deeper than {MAX_DEPTH} levels"));
        }
        let d = depth + 1;
        Ok(match &expr.expr {
            Expr::Unspecified => Estimate::scalar(0),
            Expr::Literal(lit) => match lit {
                LiteralValue::String(s) => Estimate::sized(0, s.inner().chars().count() as u64, 0),
                LiteralValue::Bytes(b) => Estimate::sized(0, b.inner().len() as u64, 0),
                _ => Estimate::scalar(0),
            },
            Expr::Ident(name) => {
                let mut e = match self.lookup(name) {
                    Some(e) => e,
                    None if name == "device" => device(),
                    None => Estimate::scalar(0),
                };
                e.cost = 1;
                e
            }
            Expr::Select(sel) => {
                let operand = self.expr(&sel.operand, d)?;
                let mut e = if sel.test {
                    Estimate::scalar(0)
                } else {
                    select(&operand, Some(&sel.field))
                };
                e.cost = operand.cost.saturating_add(1);
                e
            }
            Expr::List(list) => {
                let mut cost = 10u64;
                let mut elem = 0u64;
                for item in &list.elements {
                    let e = self.expr(item, d)?;
                    cost = cost.saturating_add(e.cost);
                    elem = elem.max(e.weight());
                }
                Estimate::sized(cost, list.elements.len() as u64, elem)
            }
            Expr::Map(map) => self.entries(30, &map.entries, d)?,
            Expr::Struct(s) => self.entries(40, &s.entries, d)?,
            Expr::Call(call) => {
                let mut args = Vec::with_capacity(call.args.len() + 1);
                if let Some(t) = &call.target {
                    args.push(self.expr(t, d)?);
                }
                for a in &call.args {
                    args.push(self.expr(a, d)?);
                }
                let base = args.iter().fold(1u64, |acc, a| acc.saturating_add(a.cost));
                let literal_key = call.args.get(1).and_then(|a| match &a.expr {
                    Expr::Literal(LiteralValue::String(s)) => Some(s.inner()),
                    _ => None,
                });
                let mut e = call_shape(&call.func_name, &args, literal_key);
                e.cost = e.cost.saturating_add(base);
                if matches!(call.func_name.as_str(), "matches" | "find" | "findAll") {
                    // The pattern is the receiver's first argument, or a global call's second.
                    let pattern = if call.target.is_some() {
                        call.args.first()
                    } else {
                        call.args.get(1)
                    };
                    let text = args.first().map_or(0, |a| a.size);
                    e.cost = e.cost.saturating_add(regex_cost(pattern, text)?);
                }
                e
            }
            Expr::Comprehension(c) => {
                let range = self.expr(&c.iter_range, d)?;
                let n = range.size;
                let var = match range.path {
                    Path::Attributes | Path::Capacity => Estimate::sized(0, MAX_DOMAIN_LEN, 0),
                    Path::AttributeDomain | Path::CapacityDomain => {
                        Estimate::sized(0, MAX_ID_LEN, 0)
                    }
                    _ => range.entry(),
                };
                let init = self.expr(&c.accu_init, d)?;
                let vars = 1 + usize::from(c.iter_var2.is_some());
                self.scopes.push((c.iter_var.clone(), var));
                if let Some(v2) = &c.iter_var2 {
                    self.scopes.push((v2.clone(), range.entry()));
                }
                // First pass: how much one step grows the accumulator.
                self.scopes.push((c.accu_var.clone(), init));
                let first = self.expr(&c.loop_step, d)?;
                self.scopes.pop();
                let accu = Estimate {
                    cost: 0,
                    size: init
                        .size
                        .saturating_add(n.saturating_mul(first.size.saturating_sub(init.size))),
                    elem: init.elem.max(first.elem),
                    path: if n == 0 { init.path } else { Path::Other },
                };
                // Second pass: the cost of a step once the accumulator has grown fully.
                self.scopes.push((c.accu_var.clone(), accu));
                let step = self.expr(&c.loop_step, d)?;
                let cond = self.expr(&c.loop_cond, d)?;
                self.scopes.pop();
                self.scopes.truncate(self.scopes.len() - vars);
                self.scopes.push((c.accu_var.clone(), accu));
                let result = self.expr(&c.result, d)?;
                self.scopes.pop();
                let per_iteration = step.cost.saturating_add(cond.cost).saturating_add(1);
                Estimate {
                    cost: range
                        .cost
                        .saturating_add(init.cost)
                        .saturating_add(n.saturating_mul(per_iteration))
                        .saturating_add(result.cost),
                    ..result
                }
            }
        })
    }

    fn entries(
        &mut self,
        base: u64,
        entries: &[cel::common::ast::IdedEntryExpr],
        d: usize,
    ) -> Result<Estimate, String> {
        let mut cost = base;
        let mut elem = 0u64;
        for entry in entries {
            let parts: Vec<&IdedExpr> = match &entry.expr {
                EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
                EntryExpr::StructField(f) => vec![&f.value],
            };
            for p in parts {
                let e = self.expr(p, d)?;
                cost = cost.saturating_add(e.cost);
                elem = elem.max(e.weight());
            }
        }
        Ok(Estimate::sized(cost, entries.len() as u64, elem))
    }
}

/// The cost of compiling a pattern and matching it against a text of `text` characters: the
/// pattern's weight (its automaton's states) once, plus 0.1 per character per state. A literal
/// pattern is weighed (and refused when invalid or too heavy) here; any other is charged at the
/// heaviest weight evaluation accepts.
fn regex_cost(pattern: Option<&IdedExpr>, text: u64) -> Result<u64, String> {
    let weight = match pattern.map(|p| &p.expr) {
        Some(Expr::Literal(LiteralValue::String(s))) => super::regexes::weight(s.inner())?,
        _ => super::regexes::MAX_PATTERN_WEIGHT,
    };
    Ok(weight.saturating_add(per_chars(text.saturating_mul(weight))))
}

/// The extra cost and the result shape of calling `name` on `args` (receiver first).
#[allow(
    clippy::too_many_lines,
    reason = "one arm per function reads best together"
)]
fn call_shape(name: &str, args: &[Estimate], literal_key: Option<&str>) -> Estimate {
    let zero = Estimate::scalar(0);
    let a = args.first().copied().unwrap_or(zero);
    let b = args.get(1).copied().unwrap_or(zero);
    let c = args.get(2).copied().unwrap_or(zero);
    let total_weight = args
        .iter()
        .fold(0u64, |acc, e| acc.saturating_add(e.weight()));
    match name {
        "_&&_"
        | "_||_"
        | "!_"
        | "@not_strictly_false"
        | "-_"
        | "_-_"
        | "_*_"
        | "_/_"
        | "_%_"
        | "size"
        | "isSorted"
        | "sign"
        | "isInteger"
        | "asInteger"
        | "asApproximateFloat"
        | "add"
        | "sub"
        | "isGreaterThan"
        | "isLessThan"
        | "compareTo"
        | "major"
        | "minor"
        | "patch"
        | "hasValue" => zero,
        "_?_:_" => Estimate {
            cost: 0,
            size: b.size.max(c.size),
            elem: b.elem.max(c.elem),
            path: if b.path == c.path {
                b.path
            } else {
                Path::Other
            },
        },
        "_[_]" | "_[?_]" => {
            let mut e = select(&a, literal_key);
            e.cost = 0;
            e
        }
        "_+_" => Estimate::sized(
            per_chars(total_weight),
            a.size.saturating_add(b.size),
            a.elem.max(b.elem),
        ),
        "_==_" | "_!=_" | "_<_" | "_<=_" | "_>_" | "_>=_" => {
            Estimate::scalar(per_chars(a.weight().max(b.weight())))
        }
        "@in" | "indexOf" | "lastIndexOf" | "contains" | "startsWith" | "endsWith" | "matches" => {
            Estimate::scalar(
                per_chars(b.size.saturating_mul(1 + a.weight()))
                    .saturating_add(b.size)
                    .saturating_add(a.size),
            )
        }
        // One linear scan of the text per pattern character (the regex crate's bound).
        "find" => Estimate::sized(per_chars(a.size.saturating_mul(1 + b.size)), a.size, 0),
        "findAll" => Estimate::sized(
            per_chars(a.size.saturating_mul(1 + b.size)),
            a.size.saturating_add(1),
            a.size,
        ),
        "charAt" => Estimate::sized(per_chars(a.size), 1, 0),
        "lowerAscii" | "upperAscii" | "trim" | "reverse" | "substring" => {
            Estimate::sized(per_chars(a.weight()).saturating_add(a.size), a.size, a.elem)
        }
        "strings.quote" => Estimate::sized(per_chars(a.size), a.size.saturating_mul(2) + 2, 0),
        "replace" => {
            let size = a
                .size
                .saturating_add(a.size.saturating_add(1).saturating_mul(c.size));
            Estimate::sized(
                per_chars(size.saturating_add(a.size.saturating_mul(b.size.max(1)))),
                size,
                0,
            )
        }
        "split" => Estimate::sized(a.size.saturating_add(1), a.size.saturating_add(1), a.size),
        "join" => {
            let size = a.size.saturating_mul(a.elem.saturating_add(b.size));
            Estimate::sized(per_chars(size).saturating_add(a.size), size, 0)
        }
        "format" => {
            let size = a
                .size
                .saturating_add(b.size.saturating_mul(b.elem.max(32).saturating_mul(4)));
            Estimate::sized(per_chars(size).saturating_add(b.size), size, 0)
        }
        "string" => Estimate::sized(per_chars(a.weight()), a.size.max(32), 0),
        "quantity" | "isQuantity" | "semver" | "isSemver" | "int" | "uint" | "double" | "bool" => {
            Estimate::scalar(per_chars(a.size))
        }
        "sum" => Estimate::sized(
            a.size.saturating_mul(1 + per_chars(a.elem)),
            a.size.saturating_mul(a.elem),
            a.elem,
        ),
        "min" | "max" => {
            Estimate::sized(a.size.saturating_mul(1 + per_chars(a.elem)), a.elem, a.elem)
        }
        "sets.contains" | "sets.equivalent" | "sets.intersects" => Estimate::scalar(
            a.size
                .saturating_mul(b.size)
                .saturating_mul(1 + per_chars(a.elem.max(b.elem)))
                .saturating_mul(2),
        ),
        "dyn" | "type" | "optional.of" | "optional.ofNonZeroValue" | "value" => {
            Estimate { cost: 0, ..a }
        }
        // Anything else: charged for touching every argument, sized as all of them together.
        _ => Estimate::sized(
            per_chars(total_weight).saturating_add(1),
            args.iter().fold(0u64, |acc, e| acc.saturating_add(e.size)),
            args.iter().fold(0u64, |acc, e| acc.max(e.elem)),
        ),
    }
}
