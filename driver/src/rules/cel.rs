//! The Kubernetes DRA CEL environment: device selectors of `DeviceClasses` and claims.
//!
//! Interface contract used by the allocator:
//! * [`CelCache::compile`] compiles an expression once and caches it by its text.
//! * [`CelDevice::new`] precomputes the `device` variable of one device (once per device).
//! * [`CompiledExpression::evaluate`] answers `Ok(true|false)`, or an error that makes the
//!   claim unsatisfiable with that reason.
//!
//! # The environment
//!
//! As upstream (`dynamic-resource-allocation/cel`): one variable, `device`, with `driver`,
//! `attributes` (domain → id → int, bool, string, semver, or a list of those), `capacity`
//! (domain → id → quantity) and `allowMultipleAllocations`. Attribute and capacity names
//! without a domain belong to the driver's domain. A domain the device lacks reads as an empty
//! map; an id it lacks is a runtime error. Beyond the CEL standard library and its macros
//! (`has`, `all`, `exists`, `exists_one`, `map`, `filter`), selectors have the strings
//! extension (`charAt`, `indexOf`, `lastIndexOf`, `lowerAscii`, `upperAscii`, `replace`,
//! `split`, `substring`, `trim`, `join`, `strings.quote`, `reverse`, `format`), Kubernetes'
//! quantity and semver libraries, its lists library (`isSorted`, `sum`, `min`, `max`,
//! `indexOf`, `lastIndexOf`), `sets.contains|equivalent|intersects`, the regex library
//! (`find`, `findAll`), optional values and `cel.bind`. `matches`, `find` and `findAll` share
//! one bounded, cached regex engine (`regexes`): a pattern longer than 1 KiB or expanding to
//! more than 10,000 automaton states is refused, and each pattern is compiled once per process.
//!
//! # Bounding the work of a selector
//!
//! Users write selectors, and the allocator evaluates each against many devices, so a
//! selector must not be able to stall it. The cel crate has no runtime cost limit, so the
//! bound is static, checked once at compile time, and a selector over it is rejected:
//! * the text may be at most [`MAX_EXPRESSION_LENGTH`] bytes (upstream's
//!   `CELSelectorExpressionMaxLength`), and the parser refuses deep nesting;
//! * the expression tree may be at most [`MAX_DEPTH`] levels deep, which bounds the
//!   recursion of estimation and evaluation;
//! * a worst-case cost is estimated over the tree (after macro expansion) and must not exceed
//!   [`MAX_COST`] (upstream's `CELSelectorExpressionMaxCost`). Each node carries a cost and
//!   an upper bound on the size of its value (characters or entries, and the weight of one
//!   entry). The `device` variable has known bounds (32 attributes and capacities per
//!   device, values of at most 64 characters), literals their own size, and each function a
//!   rule: about one unit per call plus 0.1 per character copied or scanned, as cel-go
//!   charges. A comprehension costs its range, plus, per element of the range, its step
//!   evaluated with the accumulator at its largest; the accumulator's growth is taken from
//!   one step. Unknown functions are charged for every argument they touch. The estimate is
//!   deliberately pessimistic: nested loops over big list literals, or strings doubled
//!   through `cel.bind`, blow past the limit, while `DeviceClass` selectors cost tens of units.
//!   A regular expression costs its weight (states after expanding repetitions and Unicode
//!   classes) plus 0.1 per character per state of the text it scans; a pattern computed at
//!   run time is charged at the heaviest weight accepted;
//! * the bounds of the `device` variable are enforced, not assumed: a device with a string
//!   longer than 64 characters or more than 32 attributes and capacities fails every selector
//!   (the offline tools refuse such a slice outright, as the API server does).

mod cost;
mod library;
mod regexes;
mod values;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use cel::common::ast::Expr;
use cel::common::types::{CelBool, CelInt, CelList, CelMap, CelMapKey, CelString};
use cel::common::value::{CowVal, Val};
use cel::context::VariableResolver;

pub use cost::{MAX_COST, MAX_DEPTH};
use values::{DomainMap, QuantityVal, Semver, SemverVal};

use crate::error::{Error, Result};
use crate::rules::published::{AttributeValue, PublishedDevice};
use crate::rules::quantity::Quantity;

/// The longest selector accepted, in bytes (upstream's `CELSelectorExpressionMaxLength`).
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;

/// How many compiled expressions a [`CelCache`] keeps by default.
pub const DEFAULT_CACHE_CAPACITY: usize = 1024;

/// The stack of the thread that parses an expression (reserved, touched only as needed).
const COMPILE_STACK_SIZE: usize = 256 * 1024 * 1024;

/// How much of an expression error messages quote.
const QUOTED_EXPRESSION_LENGTH: usize = 200;

/// Built once: building the standard library is far too slow to do per evaluation.
static ENVIRONMENT: LazyLock<std::result::Result<Arc<cel::Env>, String>> = LazyLock::new(|| {
    library::environment()
        .map(Arc::new)
        .map_err(|e| format!("internal error building the CEL environment: {e}"))
});

fn environment() -> std::result::Result<&'static Arc<cel::Env>, String> {
    ENVIRONMENT.as_ref().map_err(Clone::clone)
}

/// `expression`, shortened for error messages.
fn quoted(expression: &str) -> String {
    match expression.char_indices().nth(QUOTED_EXPRESSION_LENGTH) {
        Some((end, _)) => format!("{}…", &expression[..end]),
        None => expression.to_owned(),
    }
}

fn compile_error(expression: &str, message: impl Into<String>) -> Error {
    Error::CelCompile {
        expression: quoted(expression),
        message: message.into(),
    }
}

/// The `device` variable of one device, built once and reused by every expression.
#[derive(Debug)]
pub struct CelDevice {
    name: String,
    value: CelMap<'static>,
    /// Why the device cannot be evaluated at all (a malformed version or quantity), as
    /// upstream fails every selector on such a device.
    invalid: Option<String>,
}

fn key(s: impl Into<String>) -> CelMapKey<'static> {
    CelMapKey::from(s.into())
}

fn attribute_value(attr: &AttributeValue) -> std::result::Result<Box<dyn Val>, String> {
    fn list<T>(
        items: &[T],
        f: impl Fn(&T) -> std::result::Result<Box<dyn Val>, String>,
    ) -> std::result::Result<Box<dyn Val>, String> {
        let items = items
            .iter()
            .map(f)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Box::new(CelList::from(items)))
    }
    // The cost bound assumes the API's limits on what a device holds; a device beyond them
    // (one that never went through an API server) fails every selector instead of costing more.
    let string = |s: &str| -> std::result::Result<Box<dyn Val>, String> {
        if s.len() > crate::rules::limits::MAX_VALUE_LENGTH {
            return Err(format!(
                "value of {} characters, more than the API's limit of {}",
                s.len(),
                crate::rules::limits::MAX_VALUE_LENGTH
            ));
        }
        Ok(Box::new(CelString::from(s.to_owned())))
    };
    let version = |v: &str| -> std::result::Result<Box<dyn Val>, String> {
        Semver::parse(v)
            .map(|v| Box::new(SemverVal(v)) as Box<dyn Val>)
            .map_err(|e| format!("version {v:?}: {e}"))
    };
    match attr {
        AttributeValue::String(s) => string(s),
        AttributeValue::Bool(b) => Ok(Box::new(CelBool::from(*b))),
        AttributeValue::Int(i) => Ok(Box::new(CelInt::from(*i))),
        AttributeValue::Version(v) => version(v),
        AttributeValue::Strings(items) => list(items, |s| string(s)),
        AttributeValue::Bools(items) => list(items, |b| Ok(Box::new(CelBool::from(*b)))),
        AttributeValue::Ints(items) => list(items, |i| Ok(Box::new(CelInt::from(*i)))),
        AttributeValue::Versions(items) => list(items, |v| version(v)),
        AttributeValue::Empty => Err("no value".to_owned()),
    }
}

/// Groups `(qualified name, value)` by domain, a bare name belonging to `driver`.
fn by_domain(driver: &str, entries: impl Iterator<Item = (String, Box<dyn Val>)>) -> DomainMap {
    let mut domains: HashMap<String, HashMap<CelMapKey<'static>, Box<dyn Val>>> = HashMap::new();
    for (name, value) in entries {
        let (domain, id) = match name.split_once('/') {
            Some((d, i)) => (d.to_owned(), i.to_owned()),
            None => (driver.to_owned(), name),
        };
        domains.entry(domain).or_default().insert(key(id), value);
    }
    let outer: HashMap<CelMapKey<'static>, Box<dyn Val>> = domains
        .into_iter()
        .map(|(d, ids)| (key(d), Box::new(CelMap::from(ids)) as Box<dyn Val>))
        .collect();
    DomainMap::new(CelMap::from(outer))
}

impl CelDevice {
    /// Builds the CEL view of `device`, published by `driver`.
    pub fn new(driver: &str, device: &PublishedDevice) -> Self {
        let mut invalid = None;
        let mut note = |what: &str, name: &str, reason: String| {
            invalid.get_or_insert_with(|| format!("{what} {name}: {reason}"));
        };
        let entries = device.entries();
        if entries > crate::rules::limits::MAX_ATTRIBUTES_AND_CAPACITIES {
            note(
                "device",
                &device.name,
                format!(
                    "{entries} attributes and capacities, more than the API's limit of {}",
                    crate::rules::limits::MAX_ATTRIBUTES_AND_CAPACITIES
                ),
            );
        }
        let mut attributes = Vec::new();
        for (name, attr) in device.attributes() {
            match attribute_value(attr) {
                Ok(v) => attributes.push((name.to_owned(), v)),
                Err(reason) => note("attribute", name, reason),
            }
        }
        let mut capacity = Vec::new();
        for (name, cap) in device.capacities() {
            match Quantity::from_k8s(&cap.value) {
                Ok(q) => capacity.push((name.to_owned(), Box::new(QuantityVal(q)) as Box<dyn Val>)),
                Err(e) => note("capacity", name, e.to_string()),
            }
        }
        let fields: HashMap<CelMapKey<'static>, Box<dyn Val>> = HashMap::from([
            (
                key("driver"),
                Box::new(CelString::from(driver.to_owned())) as Box<dyn Val>,
            ),
            (
                key("attributes"),
                Box::new(by_domain(driver, attributes.into_iter())),
            ),
            (
                key("capacity"),
                Box::new(by_domain(driver, capacity.into_iter())),
            ),
            (
                key("allowMultipleAllocations"),
                Box::new(CelBool::from(
                    device.allow_multiple_allocations.unwrap_or(false),
                )),
            ),
        ]);
        Self {
            name: device.name.clone(),
            value: CelMap::from(fields),
            invalid,
        }
    }

    /// The device's name, for error messages.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl VariableResolver for CelDevice {
    fn resolve<'b>(&'b self, variable: &str) -> Option<CowVal<'b, 'b>> {
        (variable == "device").then(|| CowVal::Borrowed(&self.value as &dyn Val))
    }
}

/// A compiled selector expression.
pub struct CompiledExpression {
    source: String,
    program: cel::Program,
    max_cost: u64,
}

impl std::fmt::Debug for CompiledExpression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledExpression")
            .field("source", &self.source)
            .field("max_cost", &self.max_cost)
            .finish_non_exhaustive()
    }
}

/// Compiles `expression` without caching: checks its length, parses it, refuses results that
/// are plainly not a bool, and estimates its worst-case cost (see the module docs).
///
/// # Errors
///
/// [`Error::CelCompile`] naming the rule the expression breaks.
pub fn compile(expression: &str) -> Result<CompiledExpression> {
    check_length(expression)?;
    // The parser recurses once per nesting level and per operator of a chain such as
    // `1 + 1 + ...`; within the length limit that fits in a dedicated thread's stack, and a
    // tree that deep is then refused (and dropped) there, never on the caller's stack.
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("cel-compile".into())
            .stack_size(COMPILE_STACK_SIZE)
            .spawn_scoped(scope, || compile_on_this_thread(expression))
            .map_err(|e| compile_error(expression, format!("cannot start the compiler: {e}")))?
            .join()
            .map_err(|_| compile_error(expression, "internal error: the compiler panicked"))?
    })
}

/// Refuses an expression longer than [`MAX_EXPRESSION_LENGTH`].
fn check_length(expression: &str) -> Result<()> {
    if expression.len() > MAX_EXPRESSION_LENGTH {
        return Err(compile_error(
            expression,
            format!(
                "expression is {} bytes long, more than the limit of {MAX_EXPRESSION_LENGTH}",
                expression.len()
            ),
        ));
    }
    Ok(())
}

fn compile_on_this_thread(expression: &str) -> Result<CompiledExpression> {
    check_length(expression)?;
    let env = environment().map_err(|e| compile_error(expression, e))?;
    let program = env
        .compile(expression)
        .map_err(|e| compile_error(expression, e.to_string()))?;
    let root = program.expression();
    match &root.expr {
        Expr::Literal(cel::common::ast::LiteralValue::Boolean(_)) => {}
        Expr::Literal(_) | Expr::List(_) | Expr::Map(_) | Expr::Struct(_) => {
            return Err(compile_error(expression, "must evaluate to bool"));
        }
        _ => {}
    }
    let estimate = cost::estimate(root).map_err(|e| compile_error(expression, e))?;
    if estimate.cost > MAX_COST {
        return Err(compile_error(
            expression,
            format!(
                "estimated worst-case cost {} exceeds the limit of {MAX_COST}; \
                 simplify the expression (fewer nested loops, smaller literals)",
                estimate.cost
            ),
        ));
    }
    Ok(CompiledExpression {
        source: expression.to_owned(),
        program,
        max_cost: estimate.cost,
    })
}

impl CompiledExpression {
    /// The expression's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The estimated worst-case cost of one evaluation (at most [`MAX_COST`]).
    pub fn max_cost(&self) -> u64 {
        self.max_cost
    }

    fn runtime_error(&self, device: &CelDevice, message: String) -> Error {
        Error::CelRuntime {
            expression: quoted(&self.source),
            device: device.name.clone(),
            message,
        }
    }

    /// Evaluates the expression against one device.
    ///
    /// Per call this only builds an empty context around the shared environment; the device
    /// is borrowed, never copied. Measured: about 18 µs per call in a debug build for a
    /// three-clause selector (driver, model, `memory.compareTo(quantity("40Gi"))`).
    ///
    /// # Errors
    ///
    /// [`Error::CelRuntime`] when evaluation fails (an unknown attribute, a type error, a
    /// malformed value on the device) or the result is not a bool.
    pub fn evaluate(&self, device: &CelDevice) -> Result<bool> {
        if let Some(reason) = &device.invalid {
            return Err(self.runtime_error(device, reason.clone()));
        }
        let env = environment().map_err(|e| self.runtime_error(device, e))?;
        let mut ctx = cel::Context::with_env(Arc::clone(env));
        ctx.set_variable_resolver(device);
        match self.program.execute(&ctx) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(self.runtime_error(
                device,
                format!("must evaluate to bool, not {}", other.type_of()),
            )),
            Err(e) => Err(self.runtime_error(device, e.to_string())),
        }
    }
}

/// Compiles expressions once and caches them (and their compile errors) by their text.
/// Bounded: when full, an arbitrary entry makes room. Cheap to share across threads.
pub struct CelCache {
    compiled: Mutex<HashMap<String, Result<Arc<CompiledExpression>>>>,
    capacity: usize,
}

impl Default for CelCache {
    fn default() -> Self {
        Self::with_capacity(DEFAULT_CACHE_CAPACITY)
    }
}

impl std::fmt::Debug for CelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CelCache")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl CelCache {
    /// An empty cache of [`DEFAULT_CACHE_CAPACITY`] entries.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache holding at most `capacity` entries (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            compiled: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    /// How many expressions are cached.
    pub fn len(&self) -> usize {
        self.compiled.lock().map_or(0, |c| c.len())
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Compiles `expression`, or returns the cached compilation.
    ///
    /// # Errors
    ///
    /// [`Error::CelCompile`], see [`compile`].
    pub fn compile(&self, expression: &str) -> Result<Arc<CompiledExpression>> {
        if let Ok(cache) = self.compiled.lock()
            && let Some(hit) = cache.get(expression)
        {
            return hit.clone();
        }
        // Compiled outside the lock: other threads keep evaluating meanwhile.
        let compiled = compile(expression).map(Arc::new);
        if let Ok(mut cache) = self.compiled.lock() {
            if cache.len() >= self.capacity
                && let Some(victim) = cache.keys().next().cloned()
            {
                cache.remove(&victim);
            }
            cache.insert(expression.to_owned(), compiled.clone());
        }
        compiled
    }
}

#[cfg(test)]
mod tests;
