use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

use super::*;
use crate::rules::published::PublishedDevice;
use k8s_openapi::api::resource::v1 as res;

const DRIVER: &str = "gpu.tessera.dev";

fn attr() -> res::DeviceAttribute {
    res::DeviceAttribute::default()
}

fn gpu() -> res::Device {
    let mut attributes = BTreeMap::new();
    attributes.insert(
        "model".to_owned(),
        res::DeviceAttribute {
            string: Some("a100-80g".into()),
            ..attr()
        },
    );
    attributes.insert(
        "driverVersion".to_owned(),
        res::DeviceAttribute {
            version: Some("550.54.15".into()),
            ..attr()
        },
    );
    attributes.insert(
        "index".to_owned(),
        res::DeviceAttribute {
            int: Some(3),
            ..attr()
        },
    );
    attributes.insert(
        "mig".to_owned(),
        res::DeviceAttribute {
            bool: Some(false),
            ..attr()
        },
    );
    attributes.insert(
        "resource.kubernetes.io/pcieRoot".to_owned(),
        res::DeviceAttribute {
            string: Some("pci0000:00".into()),
            ..attr()
        },
    );
    attributes.insert(
        "tags".to_owned(),
        res::DeviceAttribute {
            strings: Some(vec!["fast".into(), "nvlink".into()]),
            ..attr()
        },
    );
    let mut capacity = BTreeMap::new();
    capacity.insert(
        "memory".to_owned(),
        res::DeviceCapacity {
            value: K8sQuantity("80Gi".into()),
            ..Default::default()
        },
    );
    res::Device {
        name: "gpu-3".into(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        ..Default::default()
    }
}

fn device() -> CelDevice {
    CelDevice::new(DRIVER, &PublishedDevice::from(gpu()))
}

fn eval(expression: &str) -> Result<bool> {
    compile(expression)?.evaluate(&device())
}

#[track_caller]
fn check(expression: &str) {
    assert_eq!(eval(expression), Ok(true), "{expression}");
}

#[track_caller]
fn runtime_error(expression: &str) -> String {
    match eval(expression) {
        Err(Error::CelRuntime {
            message, device, ..
        }) => {
            assert_eq!(device, "gpu-3");
            message
        }
        other => panic!("{expression}: expected a runtime error, got {other:?}"),
    }
}

#[track_caller]
fn compile_error(expression: &str) -> String {
    match compile(expression) {
        Err(Error::CelCompile { message, .. }) => message,
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn typical_device_class_selectors_match() {
    check(
        r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].model == "a100-80g""#,
    );
    check(r#"device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("40Gi")) >= 0"#);
    check(r#"device.attributes["gpu.tessera.dev"].driverVersion.isGreaterThan(semver("550.0.0"))"#);
    check(r#"device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:00""#);
    check(
        r#"device.attributes["gpu.tessera.dev"].index == 3 && !device.attributes["gpu.tessera.dev"].mig"#,
    );
    check(r#"device.attributes["gpu.tessera.dev"].model in ["a100-80g", "h100-80g"]"#);
    check(r#"device.attributes["gpu.tessera.dev"].model.startsWith("a100")"#);
    check(r#"device.attributes["gpu.tessera.dev"].tags.exists(t, t == "nvlink")"#);
    check(
        r#"cel.bind(g, device.attributes["gpu.tessera.dev"], g.model == "a100-80g" && g.index > 0)"#,
    );
    check("device.allowMultipleAllocations == false");
    assert_eq!(device().name(), "gpu-3");
    let mut shared = gpu();
    shared.allow_multiple_allocations = Some(true);
    let shared = CelDevice::new(DRIVER, &PublishedDevice::from(shared));
    assert_eq!(
        compile("device.allowMultipleAllocations")
            .unwrap()
            .evaluate(&shared),
        Ok(true)
    );
    assert_eq!(
        eval(r#"device.attributes["gpu.tessera.dev"].model == "h100""#),
        Ok(false)
    );
}

#[test]
fn unknown_domain_is_an_empty_map() {
    check(r#"!("model" in device.attributes["other.example.com"])"#);
    check(r#"size(device.attributes["other.example.com"]) == 0"#);
    check(r#"size(device.capacity["other.example.com"]) == 0"#);
    check(r#""gpu.tessera.dev" in device.attributes"#);
    check(r#"!("other.example.com" in device.attributes)"#);
    check(r#"!has(device.attributes["gpu.tessera.dev"].nope)"#);
    check("device.attributes.all(d, size(device.attributes[d]) > 0)");
}

#[test]
fn unknown_attribute_is_a_runtime_error() {
    let message = runtime_error(r#"device.attributes["gpu.tessera.dev"].nope == "x""#);
    assert!(message.contains("nope"), "{message}");
    runtime_error(r#"device.attributes["other.example.com"].model == "x""#);
    runtime_error("device.nope");
    runtime_error("nope == 1");
}

#[test]
fn type_errors_and_non_bool_results_are_runtime_errors() {
    runtime_error(
        r#"device.attributes["gpu.tessera.dev"].index == "3" || device.attributes["gpu.tessera.dev"].index > "3""#,
    );
    runtime_error(r#"device.attributes["gpu.tessera.dev"].model"#);
    runtime_error(
        r#"device.attributes["gpu.tessera.dev"].driverVersion == "550.54.15" || device.attributes["gpu.tessera.dev"].driverVersion.startsWith("5")"#,
    );
    runtime_error(r#"quantity("1Gi").isGreaterThan(semver("1.0.0"))"#);
    runtime_error("1 / 0 == 1");
    assert!(compile_error("1").contains("bool"));
    assert!(compile_error("[true]").contains("bool"));
    assert!(compile_error("device.driver ==").contains("ERROR"));
}

#[test]
fn a_version_attribute_is_a_semver_not_a_string() {
    check(r#"device.attributes["gpu.tessera.dev"].driverVersion == semver("550.54.15")"#);
    check(r#"device.attributes["gpu.tessera.dev"].driverVersion.major() == 550"#);
}

#[test]
fn a_malformed_device_fails_every_selector() {
    let mut d = gpu();
    d.attributes.as_mut().unwrap().insert(
        "bad".into(),
        res::DeviceAttribute {
            version: Some("1.0".into()),
            ..attr()
        },
    );
    let err = compile("true")
        .unwrap()
        .evaluate(&CelDevice::new(DRIVER, &PublishedDevice::from(d)));
    assert!(matches!(err, Err(Error::CelRuntime { message, .. }) if message.contains("bad")));
}

#[test]
fn quantity_library() {
    check(r#"quantity("80Gi") == device.capacity["gpu.tessera.dev"].memory"#);
    check(r#"quantity("1Gi") == quantity("1024Mi")"#);
    check(r#"isQuantity("1.5Gi") && !isQuantity("1.5Gx") && !isQuantity("")"#);
    check(
        r#"quantity("-1").sign() == -1 && quantity("0").sign() == 0 && quantity("5m").sign() == 1"#,
    );
    check(r#"quantity("2k").isInteger() && !quantity("500m").isInteger()"#);
    check(r#"quantity("2k").asInteger() == 2000"#);
    check(r#"quantity("500m").asApproximateFloat() == 0.5"#);
    check(r#"quantity("1Gi").add(quantity("1Gi")) == quantity("2Gi")"#);
    check(r#"quantity("1Gi").add(1) == quantity("1073741825")"#);
    check(r#"quantity("1Gi").sub(quantity("512Mi")) == quantity("512Mi")"#);
    check(r#"quantity("10").sub(3) == quantity("7")"#);
    check(
        r#"quantity("2Gi").isGreaterThan(quantity("1Gi")) && quantity("1Gi").isLessThan(quantity("2Gi"))"#,
    );
    check(
        r#"quantity("1Gi").compareTo(quantity("1Gi")) == 0 && quantity("1").compareTo(quantity("2")) == -1"#,
    );
    runtime_error(r#"quantity("500m").asInteger() == 0"#);
    runtime_error(r#"quantity("abc") == quantity("1")"#);
}

#[test]
fn semver_library() {
    check(
        r#"isSemver("1.2.3") && isSemver("1.2.3-rc.1+build.5") && !isSemver("1.2") && !isSemver("v1.2.3")"#,
    );
    check(r#"!isSemver("01.2.3") && !isSemver("1.2.3-") && !isSemver("1.2.3-01")"#);
    check(r#"isSemver("v1.2", true) && isSemver("01.02.03", true) && !isSemver("1.2-rc", true)"#);
    check(
        r#"semver("v1.2", true) == semver("1.2.0") && semver("01.01.01", true) == semver("1.1.1")"#,
    );
    check(
        r#"semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3"#,
    );
    check(r#"semver("1.0.0").isGreaterThan(semver("1.0.0-rc.1"))"#);
    check(r#"semver("1.0.0-alpha").isLessThan(semver("1.0.0-alpha.1"))"#);
    check(r#"semver("1.0.0-alpha.1").isLessThan(semver("1.0.0-alpha.beta"))"#);
    check(r#"semver("1.0.0-2").isLessThan(semver("1.0.0-10"))"#);
    check(
        r#"semver("1.2.3").compareTo(semver("2.0.0")) == -1 && semver("1.2.3").compareTo(semver("0.1.2")) == 1"#,
    );
    check(r#"semver("1.2.3+a") == semver("1.2.3+b")"#);
    runtime_error(r#"semver("1.2") == semver("1.2.0")"#);
}

#[test]
fn strings_extension_and_standard_functions() {
    check(r#""hello".charAt(1) == "e""#);
    check(r#""hello".indexOf("l") == 2 && "hello".lastIndexOf("l") == 3"#);
    check(r#""TacoCat".lowerAscii() == "tacocat" && "TacoCat".upperAscii() == "TACOCAT""#);
    check(r#""a-b-c".replace("-", "+") == "a+b+c""#);
    check(r#""a,b,c".split(",") == ["a", "b", "c"]"#);
    check(r#""hello".substring(1, 3) == "el" && "  x ".trim() == "x""#);
    check(r#"["a", "b"].join("-") == "a-b""#);
    check(r#"strings.quote("a\"b") == "\"a\\\"b\"""#);
    check(r#""abc".reverse() == "cba""#);
    check(r#""%s-%d".format(["a", 1]) == "a-1""#);
    check(r#""a100-80g".matches("^a100-[0-9]+g$") && "abc".contains("b") && "abc".endsWith("c")"#);
    check(r#"size("abc") == 3 && "abc".size() == 3 && size([1, 2]) == 2"#);
}

#[test]
fn macros() {
    check("[1, 2, 3].all(x, x > 0)");
    check("[1, 2, 3].exists(x, x == 2)");
    check("[1, 2, 3].exists_one(x, x == 2)");
    check("[1, 2, 3].map(x, x * 2) == [2, 4, 6]");
    check("[1, 2, 3].filter(x, x > 1) == [2, 3]");
    check("has(device.driver)");
}

#[test]
fn lists_and_sets_libraries() {
    check("[1, 2, 3].isSorted() && ![3, 1].isSorted() && [].isSorted()");
    check("[1, 2, 3].sum() == 6 && [].sum() == 0 && [1.5, 2.5].sum() == 4.0");
    check("[3, 1, 2].min() == 1 && [3, 1, 2].max() == 3");
    check(r#"["b", "a"].min() == "a""#);
    check("[1, 2, 1].indexOf(1) == 0 && [1, 2, 1].lastIndexOf(1) == 2 && [1].indexOf(5) == -1");
    check("sets.contains([1, 2, 3], [3, 1]) && !sets.contains([1], [2])");
    check("sets.equivalent([1, 2], [2, 1, 1]) && !sets.equivalent([1], [1, 2])");
    check("sets.intersects([1, 2], [2, 5]) && !sets.intersects([1], [2])");
    runtime_error("[].min() == 0");
}

#[test]
fn optional_values() {
    check(r#"device.attributes["gpu.tessera.dev"].?model.orValue("none") == "a100-80g""#);
    check(r#"device.attributes["gpu.tessera.dev"].?nope.orValue("none") == "none""#);
}

#[test]
fn long_expressions_are_rejected() {
    let long = format!("device.driver == \"{}\"", "x".repeat(MAX_EXPRESSION_LENGTH));
    assert!(compile_error(&long).contains("limit"));
    // Errors quote a shortened expression.
    let Err(Error::CelCompile { expression, .. }) = compile(&long) else {
        panic!("expected a compile error");
    };
    assert!(expression.len() < 1000);
}

#[test]
fn deep_nesting_is_rejected() {
    let deep = format!("{}true{}", "(".repeat(500), ")".repeat(500));
    compile_error(&deep);
    let deep = format!("size({}1{}) == 1", "[".repeat(2000), "]".repeat(2000));
    compile_error(&deep);
    // Negations cancel out in pairs while parsing: harmless however many.
    assert!(compile(&format!("{}true", "!".repeat(2000))).is_ok());
    let chain = vec!["1"; 3000].join(" + ");
    compile_error(&format!("{chain} == 3000"));
}

#[test]
/// Refused at compile time, by the cost estimate or the depth limit: nothing of them is ever
/// evaluated, so their time is bounded by the compiler's, not by what they would do.
fn pathological_expressions_are_refused_by_cost_or_depth_before_they_run() {
    let big = format!("[{}]", vec!["1"; 1000].join(","));
    let cases = [
        format!("{big}.all(x, {big}.all(y, {big}.all(z, x + y + z > 0)))"),
        format!("{big}.map(x, {big}.map(y, {big})).size() > 0"),
        format!(
            "cel.bind(a, \"{}\", {} size(a) > 0)",
            "x".repeat(64),
            "cel.bind(a, a + a, ".repeat(60)
        ) + &")".repeat(60),
        format!("{big}.map(x, \"{}\").join(\"\").split(\"\").map(c, {big}).size() > 0", "x".repeat(64)),
        r#"device.attributes.all(d, device.attributes.all(e, device.attributes[d].all(k, device.attributes[e].all(j, [1,2,3,4,5,6,7,8,9,10].all(z, string(device.attributes[d][k]) + string(device.attributes[e][j]) != "")))))"#.to_owned(),
    ];
    for expression in cases {
        let message = compile_error(&expression);
        assert!(
            message.contains("cost") || message.contains("deeper"),
            "{message}"
        );
    }
}

#[test]
fn normal_selectors_are_cheap() {
    for expression in [
        r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].model == "a100-80g""#,
        r#"device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
        r#"device.attributes["gpu.tessera.dev"].tags.exists(t, t.startsWith("nv"))"#,
        r#"device.attributes.exists(d, d.endsWith(".tessera.dev") && device.attributes[d].all(k, k != ""))"#,
    ] {
        let compiled = compile(expression).unwrap();
        assert!(
            compiled.max_cost() < 100_000,
            "{expression}: {}",
            compiled.max_cost()
        );
    }
}

#[test]
fn cache_compiles_once_and_is_bounded() {
    let cache = CelCache::with_capacity(2);
    let a = cache.compile("true").unwrap();
    let b = cache.compile("true").unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(a.source(), "true");
    assert!(cache.compile("1 +").is_err());
    assert!(cache.compile("1 +").is_err(), "errors are cached too");
    cache.compile("false").unwrap();
    cache.compile("device.driver == \"x\"").unwrap();
    assert_eq!(cache.len(), 2);
    assert_eq!(
        CelCache::new().compile("true").unwrap().evaluate(&device()),
        Ok(true)
    );
}

#[test]
fn shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CelCache>();
    send_sync::<CelDevice>();
    send_sync::<CompiledExpression>();
    let cache = Arc::new(CelCache::new());
    let d = Arc::new(device());
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (cache, d) = (Arc::clone(&cache), Arc::clone(&d));
            std::thread::spawn(move || {
                cache
                    .compile(r#"device.attributes["gpu.tessera.dev"].model == "a100-80g""#)
                    .unwrap()
                    .evaluate(&d)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), Ok(true));
    }
}

#[test]
fn a_compiled_selector_answers_the_same_on_every_evaluation() {
    // Its speed is measured by the allocator bench (driver/benches/allocate.rs evaluates the
    // classes' selectors on every device), not asserted by a test.
    let compiled = compile(
        r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].model == "a100-80g" && device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
    )
    .unwrap();
    let d = device();
    for _ in 0..1000 {
        assert_eq!(compiled.evaluate(&d), Ok(true));
    }
}

#[test]
fn regex_library_finds_matches() {
    check(r#"device.attributes["gpu.tessera.dev"].model.find("[0-9]+") == "100""#);
    check(r#"device.attributes["gpu.tessera.dev"].model.find("^h") == """#);
    check(r#"device.attributes["gpu.tessera.dev"].model.findAll("[0-9]+") == ["100", "80"]"#);
    check(r#"device.attributes["gpu.tessera.dev"].model.findAll("[0-9]+", 1) == ["100"]"#);
    check(r#"device.attributes["gpu.tessera.dev"].model.findAll("[0-9]+", -1).size() == 2"#);
    let err = eval(r#"device.attributes["gpu.tessera.dev"].model.find("(") == """#).unwrap_err();
    assert!(
        err.to_string().contains("invalid regular expression"),
        "{err}"
    );
}

#[test]
fn a_repeated_unicode_class_is_too_expensive() {
    let e = compile_error(r#"device.attributes["gpu.tessera.dev"].model.matches("\\w{200}")"#);
    assert!(e.contains("too expensive"), "{e}");
}

#[test]
fn many_regex_calls_in_one_selector_add_up() {
    let one = r#"device.driver.matches("[a-z]{999}")"#;
    let many = vec![one; 155].join(" || ");
    assert!(many.len() <= MAX_EXPRESSION_LENGTH);
    let e = compile_error(&many);
    assert!(e.contains("exceeds the limit"), "{e}");
    // A handful of such calls is fine, and each pattern is compiled once however often it runs.
    let few = [one; 3].join(" || ");
    check(&format!("!({few})"));
}

#[test]
fn a_pattern_built_at_run_time_is_bounded_when_evaluated() {
    let e = runtime_error(r#""x".matches(device.attributes["gpu.tessera.dev"].model + "{9999}")"#);
    assert!(e.contains("too expensive"), "{e}");
}

#[test]
fn an_attribute_beyond_the_api_limits_fails_every_selector() {
    let mut d = gpu();
    d.attributes.as_mut().unwrap().insert(
        "long".into(),
        res::DeviceAttribute {
            string: Some("x".repeat(20_000)),
            ..attr()
        },
    );
    let err = compile("true")
        .unwrap()
        .evaluate(&CelDevice::new(DRIVER, &PublishedDevice::from(d)));
    assert!(
        matches!(err, Err(Error::CelRuntime { message, .. }) if message.contains("limit of 64"))
    );
}
