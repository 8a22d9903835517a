//! The Kubernetes DRA CEL environment (interface; the full environment is being built).
//!
//! Interface contract used by the allocator:
//! * [`CelCache::compile`] compiles an expression once and caches it by its text.
//! * [`CelDevice::new`] precomputes the `device` variable of one device (once per device).
//! * [`CompiledExpression::evaluate`] answers `Ok(true|false)`, or an error that makes the
//!   claim unsatisfiable with that reason.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::resource::v1 as res;

use crate::error::{Error, Result};

/// The `device` variable of one device, built once and reused by every expression.
#[derive(Debug, Clone)]
pub struct CelDevice {
    name: String,
    value: cel::Value,
}

impl CelDevice {
    /// Builds the CEL view of `device`, published by `driver`.
    pub fn new(driver: &str, device: &res::Device) -> Self {
        let mut attributes: HashMap<String, HashMap<String, cel::Value>> = HashMap::new();
        for (name, attr) in device.attributes.iter().flatten() {
            let (domain, id) = match name.split_once('/') {
                Some((d, i)) => (d.to_owned(), i.to_owned()),
                None => (driver.to_owned(), name.clone()),
            };
            let value = if let Some(s) = &attr.string {
                cel::Value::from(s.as_str())
            } else if let Some(b) = attr.bool {
                cel::Value::Bool(b)
            } else if let Some(i) = attr.int {
                cel::Value::Int(i)
            } else if let Some(v) = &attr.version {
                cel::Value::from(v.as_str())
            } else {
                cel::Value::Null
            };
            attributes.entry(domain).or_default().insert(id, value);
        }
        let mut map: HashMap<String, cel::Value> = HashMap::new();
        map.insert("driver".into(), cel::Value::from(driver));
        map.insert("attributes".into(), cel::Value::from(attributes));
        Self {
            name: device.name.clone(),
            value: cel::Value::from(map),
        }
    }

    /// The device's name, for error messages.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A compiled selector expression.
pub struct CompiledExpression {
    source: String,
    program: cel::Program,
}

impl std::fmt::Debug for CompiledExpression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledExpression")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl CompiledExpression {
    /// The expression's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates the expression against one device.
    pub fn evaluate(&self, device: &CelDevice) -> Result<bool> {
        let mut ctx = cel::Context::default();
        ctx.add_variable_from_value("device", device.value.clone());
        match self.program.execute(&ctx) {
            Ok(cel::Value::Bool(b)) => Ok(b),
            Ok(other) => Err(Error::CelRuntime {
                expression: self.source.clone(),
                device: device.name.clone(),
                message: format!("result is {other:?}, not a bool"),
            }),
            Err(e) => Err(Error::CelRuntime {
                expression: self.source.clone(),
                device: device.name.clone(),
                message: e.to_string(),
            }),
        }
    }
}

/// Compiles expressions once and caches them by their text. Cheap to share across threads.
#[derive(Default)]
pub struct CelCache {
    compiled: Mutex<HashMap<String, Arc<CompiledExpression>>>,
}

impl std::fmt::Debug for CelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CelCache").finish_non_exhaustive()
    }
}

impl CelCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Compiles `expression`, or returns the cached compilation.
    pub fn compile(&self, expression: &str) -> Result<Arc<CompiledExpression>> {
        if let Ok(cache) = self.compiled.lock()
            && let Some(hit) = cache.get(expression)
        {
            return Ok(Arc::clone(hit));
        }
        let program = cel::Program::compile(expression).map_err(|e| Error::CelCompile {
            expression: expression.to_owned(),
            message: e.to_string(),
        })?;
        let compiled = Arc::new(CompiledExpression {
            source: expression.to_owned(),
            program,
        });
        if let Ok(mut cache) = self.compiled.lock() {
            cache.insert(expression.to_owned(), Arc::clone(&compiled));
        }
        Ok(compiled)
    }
}
