//! The functions of the DRA environment beyond the CEL standard library and the cel crate's
//! strings extension: Kubernetes' quantity, semver, lists and regex libraries, `sets.*`, and
//! the `cel.bind` macro.

#![allow(
    clippy::needless_pass_by_value,
    clippy::unnecessary_wraps,
    reason = "overloads must match the cel crate's `Function` signature"
)]

use std::cmp::Ordering;

use cel::common::ast::{ComprehensionExpr, Expr, IdedExpr, ListExpr, LiteralValue};
use cel::common::types::{
    BOOL_TYPE, CelBool, CelDouble, CelInt, CelList, CelString, DYN_TYPE, INT_TYPE, LIST_TYPE,
    STRING_TYPE, Type,
};
use cel::common::value::{CowVal, Val};
use cel::parser::{Macro, MacroExprHelper, ParseError};
use cel::{DeclarationError, Env, ExecutionError};

use super::values::{QUANTITY_TYPE, QuantityVal, SEMVER_TYPE, Semver, SemverVal};
use crate::rules::quantity::Quantity;

type CelResult<'b, 'v> = Result<CowVal<'b, 'v>, ExecutionError>;

/// Builds the environment every selector is compiled and evaluated in.
pub(crate) fn environment() -> Result<Env, DeclarationError> {
    let mut env = Env::stdlib();
    env.add_extension(cel::extensions::strings)?;
    quantity_library(&mut env)?;
    semver_library(&mut env)?;
    lists_library(&mut env)?;
    sets_library(&mut env)?;
    regex_library(&mut env)?;
    env.add_macro(Macro::receiver("bind", 3, bind_macro))?;
    Ok(env)
}

fn quantity_type() -> Type {
    Type::to_owned(&QUANTITY_TYPE)
}

fn semver_type() -> Type {
    Type::to_owned(&SEMVER_TYPE)
}

fn bool_val<'b, 'v>(b: bool) -> CelResult<'b, 'v> {
    Ok(CowVal::owned(CelBool::from(b)))
}

fn int_val<'b, 'v>(i: i64) -> CelResult<'b, 'v> {
    Ok(CowVal::owned(CelInt::from(i)))
}

fn ordering_val<'b, 'v>(o: Ordering) -> CelResult<'b, 'v> {
    int_val(match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    })
}

fn arg<'a, 'b, 'v>(
    args: &'a [CowVal<'b, 'v>],
    i: usize,
) -> Result<&'a (dyn Val + 'v), ExecutionError> {
    args.get(i)
        .map(AsRef::as_ref)
        .ok_or_else(|| ExecutionError::invalid_argument_count(i + 1, args.len()))
}

fn string_arg<'a>(
    args: &'a [CowVal<'_, '_>],
    i: usize,
    f: &str,
) -> Result<&'a str, ExecutionError> {
    arg(args, i)?
        .downcast_ref::<CelString>()
        .map(CelString::inner)
        .ok_or_else(|| ExecutionError::function_error(f, "expected a string argument"))
}

fn bool_arg(args: &[CowVal<'_, '_>], i: usize, f: &str) -> Result<bool, ExecutionError> {
    arg(args, i)?
        .downcast_ref::<CelBool>()
        .map(|b| *b.inner())
        .ok_or_else(|| ExecutionError::function_error(f, "expected a bool argument"))
}

fn quantity_arg(args: &[CowVal<'_, '_>], i: usize, f: &str) -> Result<Quantity, ExecutionError> {
    let a = arg(args, i)?;
    if let Some(q) = a.downcast_ref::<QuantityVal>() {
        return Ok(q.0);
    }
    // `add` and `sub` also take a plain int, as whole units.
    a.downcast_ref::<CelInt>()
        .map(|i| Quantity::from_units(*i.inner()))
        .ok_or_else(|| ExecutionError::function_error(f, "expected a quantity argument"))
}

fn semver_arg<'a>(
    args: &'a [CowVal<'_, '_>],
    i: usize,
    f: &str,
) -> Result<&'a Semver, ExecutionError> {
    arg(args, i)?
        .downcast_ref::<SemverVal>()
        .map(|s| &s.0)
        .ok_or_else(|| ExecutionError::function_error(f, "expected a semver argument"))
}

fn list_arg<'a, 'v>(
    args: &'a [CowVal<'_, 'v>],
    i: usize,
    f: &str,
) -> Result<&'a [Box<dyn Val + 'v>], ExecutionError> {
    arg(args, i)?
        .downcast_ref::<CelList>()
        .map(CelList::inner)
        .ok_or_else(|| ExecutionError::function_error(f, "expected a list argument"))
}

// ---------------------------------------------------------------- regex

/// The standard `matches` (`s.matches(re)`, `matches(s, re)`) and Kubernetes' regex library:
/// `s.find(re)` (the first match, or `""`) and `s.findAll(re)` / `s.findAll(re, n)` (all
/// matches, or at most `n` when `n` is not negative). Patterns are bounded and compiled once
/// (see [`super::regexes`]); the regex crate matches in linear time, so a user's pattern cannot
/// backtrack forever.
fn regex_library(env: &mut Env) -> Result<(), DeclarationError> {
    env.add_overload(
        "matches",
        "matches",
        vec![STRING_TYPE, STRING_TYPE],
        regex_matches,
    )?;
    env.add_member_overload(
        "matches",
        "string_matches_string",
        STRING_TYPE,
        vec![STRING_TYPE],
        regex_matches,
    )?;
    env.add_member_overload(
        "find",
        "string_find_string",
        STRING_TYPE,
        vec![STRING_TYPE],
        regex_find,
    )?;
    env.add_member_overload(
        "findAll",
        "string_find_all_string",
        STRING_TYPE,
        vec![STRING_TYPE],
        regex_find_all,
    )?;
    env.add_member_overload(
        "findAll",
        "string_find_all_string_int",
        STRING_TYPE,
        vec![STRING_TYPE, INT_TYPE],
        regex_find_all,
    )?;
    Ok(())
}

fn compile_regex(pattern: &str, f: &str) -> Result<std::sync::Arc<regex::Regex>, ExecutionError> {
    super::regexes::compiled(pattern).map_err(|e| ExecutionError::function_error(f, e))
}

fn regex_matches<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let text = string_arg(&args, 0, "matches")?;
    let re = compile_regex(string_arg(&args, 1, "matches")?, "matches")?;
    bool_val(re.is_match(text))
}

fn regex_find<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let text = string_arg(&args, 0, "find")?;
    let re = compile_regex(string_arg(&args, 1, "find")?, "find")?;
    let found = re
        .find(text)
        .map_or_else(String::new, |m| m.as_str().to_owned());
    Ok(CowVal::owned(CelString::from(found)))
}

fn regex_find_all<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let text = string_arg(&args, 0, "findAll")?;
    let re = compile_regex(string_arg(&args, 1, "findAll")?, "findAll")?;
    let limit = match args.get(2) {
        Some(n) => {
            let n = *n
                .downcast_ref::<CelInt>()
                .ok_or_else(|| ExecutionError::function_error("findAll", "expected an int limit"))?
                .inner();
            usize::try_from(n).ok()
        }
        None => None,
    };
    let found: Vec<Box<dyn Val>> = re
        .find_iter(text)
        .take(limit.unwrap_or(usize::MAX))
        .map(|m| Box::new(CelString::from(m.as_str().to_owned())) as Box<dyn Val>)
        .collect();
    Ok(CowVal::owned(CelList::from(found)))
}

// ---------------------------------------------------------------- quantity

fn quantity_library(env: &mut Env) -> Result<(), DeclarationError> {
    let q = quantity_type;
    env.add_overload(
        "quantity",
        "string_to_quantity",
        vec![STRING_TYPE],
        quantity_parse,
    )?;
    env.add_overload(
        "isQuantity",
        "is_quantity_string",
        vec![STRING_TYPE],
        is_quantity,
    )?;
    env.add_member_overload("sign", "quantity_sign", q(), vec![], quantity_sign)?;
    env.add_member_overload(
        "isInteger",
        "quantity_is_integer",
        q(),
        vec![],
        quantity_is_integer,
    )?;
    env.add_member_overload(
        "asInteger",
        "quantity_get_integer",
        q(),
        vec![],
        quantity_as_integer,
    )?;
    env.add_member_overload(
        "asApproximateFloat",
        "quantity_get_float",
        q(),
        vec![],
        quantity_as_float,
    )?;
    env.add_member_overload("add", "quantity_add", q(), vec![q()], quantity_add)?;
    env.add_member_overload("add", "quantity_add_int", q(), vec![INT_TYPE], quantity_add)?;
    env.add_member_overload("sub", "quantity_sub", q(), vec![q()], quantity_sub)?;
    env.add_member_overload("sub", "quantity_sub_int", q(), vec![INT_TYPE], quantity_sub)?;
    env.add_member_overload(
        "isGreaterThan",
        "quantity_is_greater_than",
        q(),
        vec![q()],
        quantity_gt,
    )?;
    env.add_member_overload(
        "isLessThan",
        "quantity_is_less_than",
        q(),
        vec![q()],
        quantity_lt,
    )?;
    env.add_member_overload(
        "compareTo",
        "quantity_compare_to",
        q(),
        vec![q()],
        quantity_cmp,
    )?;
    Ok(())
}

fn quantity_parse<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let text = string_arg(&args, 0, "quantity")?;
    let q = Quantity::parse(text).map_err(|e| ExecutionError::function_error("quantity", e))?;
    Ok(CowVal::owned(QuantityVal(q)))
}

fn is_quantity<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(Quantity::parse(string_arg(&args, 0, "isQuantity")?).is_ok())
}

fn quantity_sign<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    ordering_val(quantity_arg(&args, 0, "sign")?.nanos().cmp(&0))
}

fn quantity_is_integer<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(quantity_arg(&args, 0, "isInteger")?.as_units().is_some())
}

fn quantity_as_integer<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let q = quantity_arg(&args, 0, "asInteger")?;
    let units = q.as_units().ok_or_else(|| {
        ExecutionError::function_error("asInteger", format!("cannot convert {q} to an integer"))
    })?;
    int_val(units)
}

fn quantity_as_float<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let q = quantity_arg(&args, 0, "asApproximateFloat")?;
    // Approximate by definition: the nano-unit count can exceed f64's exact range.
    #[allow(
        clippy::cast_precision_loss,
        reason = "asApproximateFloat is approximate"
    )]
    let value = q.nanos() as f64 / 1e9;
    Ok(CowVal::owned(CelDouble::from(value)))
}

fn quantity_add<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let sum = quantity_arg(&args, 0, "add")?
        .checked_add(quantity_arg(&args, 1, "add")?)
        .ok_or_else(|| ExecutionError::function_error("add", "quantity overflow"))?;
    Ok(CowVal::owned(QuantityVal(sum)))
}

fn quantity_sub<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let diff = quantity_arg(&args, 0, "sub")?
        .checked_sub(quantity_arg(&args, 1, "sub")?)
        .ok_or_else(|| ExecutionError::function_error("sub", "quantity overflow"))?;
    Ok(CowVal::owned(QuantityVal(diff)))
}

fn quantity_gt<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(quantity_arg(&args, 0, "isGreaterThan")? > quantity_arg(&args, 1, "isGreaterThan")?)
}

fn quantity_lt<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(quantity_arg(&args, 0, "isLessThan")? < quantity_arg(&args, 1, "isLessThan")?)
}

fn quantity_cmp<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    ordering_val(quantity_arg(&args, 0, "compareTo")?.cmp(&quantity_arg(&args, 1, "compareTo")?))
}

// ---------------------------------------------------------------- semver

fn semver_library(env: &mut Env) -> Result<(), DeclarationError> {
    let s = semver_type;
    env.add_overload(
        "semver",
        "string_to_semver",
        vec![STRING_TYPE],
        semver_parse,
    )?;
    env.add_overload(
        "semver",
        "string_bool_to_semver",
        vec![STRING_TYPE, BOOL_TYPE],
        semver_parse,
    )?;
    env.add_overload("isSemver", "is_semver_string", vec![STRING_TYPE], is_semver)?;
    env.add_overload(
        "isSemver",
        "is_semver_string_bool",
        vec![STRING_TYPE, BOOL_TYPE],
        is_semver,
    )?;
    env.add_member_overload("major", "semver_major", s(), vec![], semver_major)?;
    env.add_member_overload("minor", "semver_minor", s(), vec![], semver_minor)?;
    env.add_member_overload("patch", "semver_patch", s(), vec![], semver_patch)?;
    env.add_member_overload(
        "isGreaterThan",
        "semver_is_greater_than",
        s(),
        vec![s()],
        semver_gt,
    )?;
    env.add_member_overload(
        "isLessThan",
        "semver_is_less_than",
        s(),
        vec![s()],
        semver_lt,
    )?;
    env.add_member_overload("compareTo", "semver_compare_to", s(), vec![s()], semver_cmp)?;
    Ok(())
}

fn parse_semver_args(
    args: &[CowVal<'_, '_>],
    f: &str,
) -> Result<Result<Semver, String>, ExecutionError> {
    let text = string_arg(args, 0, f)?;
    let normalize = if args.len() > 1 {
        bool_arg(args, 1, f)?
    } else {
        false
    };
    Ok(if normalize {
        Semver::parse_normalized(text)
    } else {
        Semver::parse(text)
    })
}

fn semver_parse<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let v = parse_semver_args(&args, "semver")?
        .map_err(|e| ExecutionError::function_error("semver", e))?;
    Ok(CowVal::owned(SemverVal(v)))
}

fn is_semver<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(parse_semver_args(&args, "isSemver")?.is_ok())
}

fn semver_part<'b, 'v>(
    args: &[CowVal<'_, '_>],
    f: &str,
    part: fn(&Semver) -> u64,
) -> CelResult<'b, 'v> {
    let n = part(semver_arg(args, 0, f)?);
    int_val(i64::try_from(n).map_err(|_| ExecutionError::function_error(f, "out of int range"))?)
}

fn semver_major<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    semver_part(&args, "major", |v| v.major)
}

fn semver_minor<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    semver_part(&args, "minor", |v| v.minor)
}

fn semver_patch<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    semver_part(&args, "patch", |v| v.patch)
}

fn semver_gt<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(semver_arg(&args, 0, "isGreaterThan")? > semver_arg(&args, 1, "isGreaterThan")?)
}

fn semver_lt<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(semver_arg(&args, 0, "isLessThan")? < semver_arg(&args, 1, "isLessThan")?)
}

fn semver_cmp<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    ordering_val(semver_arg(&args, 0, "compareTo")?.cmp(semver_arg(&args, 1, "compareTo")?))
}

// ---------------------------------------------------------------- lists

fn lists_library(env: &mut Env) -> Result<(), DeclarationError> {
    env.add_member_overload(
        "isSorted",
        "list_is_sorted",
        LIST_TYPE,
        vec![],
        list_is_sorted,
    )?;
    env.add_member_overload("sum", "list_sum", LIST_TYPE, vec![], list_sum)?;
    env.add_member_overload("min", "list_min", LIST_TYPE, vec![], list_min)?;
    env.add_member_overload("max", "list_max", LIST_TYPE, vec![], list_max)?;
    env.add_member_overload(
        "indexOf",
        "list_index_of",
        LIST_TYPE,
        vec![DYN_TYPE],
        list_index_of,
    )?;
    env.add_member_overload(
        "lastIndexOf",
        "list_last_index_of",
        LIST_TYPE,
        vec![DYN_TYPE],
        list_last_index_of,
    )?;
    Ok(())
}

fn compare(a: &dyn Val, b: &dyn Val, f: &str) -> Result<Ordering, ExecutionError> {
    a.as_comparer()
        .ok_or_else(|| {
            ExecutionError::function_error(
                f,
                format!("{} values are not comparable", a.get_type().name()),
            )
        })?
        .compare(b)
}

fn list_is_sorted<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let list = list_arg(&args, 0, "isSorted")?;
    for pair in list.windows(2) {
        if compare(pair[0].as_ref(), pair[1].as_ref(), "isSorted")? == Ordering::Greater {
            return bool_val(false);
        }
    }
    bool_val(true)
}

fn list_sum<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let list = list_arg(&args, 0, "sum")?;
    let Some((first, rest)) = list.split_first() else {
        return int_val(0);
    };
    let mut acc: Box<dyn Val + 'v> = first.clone();
    for item in rest {
        let adder = acc.as_adder().ok_or_else(|| {
            ExecutionError::function_error(
                "sum",
                format!("cannot add {} values", item.get_type().name()),
            )
        })?;
        let next = adder.add(item.as_ref())?.into_owned();
        acc = next;
    }
    Ok(CowVal::Owned(acc))
}

fn list_extreme<'b, 'v>(args: &[CowVal<'b, 'v>], f: &str, keep: Ordering) -> CelResult<'b, 'v> {
    let list = list_arg(args, 0, f)?;
    let mut best = list
        .first()
        .ok_or_else(|| ExecutionError::function_error(f, "empty list"))?;
    for item in &list[1..] {
        if compare(item.as_ref(), best.as_ref(), f)? == keep {
            best = item;
        }
    }
    Ok(CowVal::Owned(best.clone()))
}

fn list_min<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    list_extreme(&args, "min", Ordering::Less)
}

fn list_max<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    list_extreme(&args, "max", Ordering::Greater)
}

fn position(list: &[Box<dyn Val + '_>], needle: &dyn Val, from_end: bool) -> i64 {
    let found = if from_end {
        list.iter().rposition(|v| v.equals(needle))
    } else {
        list.iter().position(|v| v.equals(needle))
    };
    found.and_then(|i| i64::try_from(i).ok()).unwrap_or(-1)
}

fn list_index_of<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    int_val(position(
        list_arg(&args, 0, "indexOf")?,
        arg(&args, 1)?,
        false,
    ))
}

fn list_last_index_of<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    int_val(position(
        list_arg(&args, 0, "lastIndexOf")?,
        arg(&args, 1)?,
        true,
    ))
}

// ---------------------------------------------------------------- sets

fn sets_library(env: &mut Env) -> Result<(), DeclarationError> {
    let two = || vec![LIST_TYPE, LIST_TYPE];
    env.add_overload(
        "sets.contains",
        "list_sets_contains_list",
        two(),
        sets_contains,
    )?;
    env.add_overload(
        "sets.equivalent",
        "list_sets_equivalent_list",
        two(),
        sets_equivalent,
    )?;
    env.add_overload(
        "sets.intersects",
        "list_sets_intersects_list",
        two(),
        sets_intersects,
    )?;
    Ok(())
}

fn contains_all(a: &[Box<dyn Val + '_>], b: &[Box<dyn Val + '_>]) -> bool {
    b.iter().all(|x| a.iter().any(|y| y.equals(x.as_ref())))
}

fn sets_contains<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    bool_val(contains_all(
        list_arg(&args, 0, "sets.contains")?,
        list_arg(&args, 1, "sets.contains")?,
    ))
}

fn sets_equivalent<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let a = list_arg(&args, 0, "sets.equivalent")?;
    let b = list_arg(&args, 1, "sets.equivalent")?;
    bool_val(contains_all(a, b) && contains_all(b, a))
}

fn sets_intersects<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> CelResult<'b, 'v> {
    let a = list_arg(&args, 0, "sets.intersects")?;
    let b = list_arg(&args, 1, "sets.intersects")?;
    bool_val(b.iter().any(|x| a.iter().any(|y| y.equals(x.as_ref()))))
}

// ---------------------------------------------------------------- cel.bind

/// `cel.bind(name, init, body)`: evaluates `body` with `name` bound to `init`, expanded (as
/// cel-go does) into a comprehension over an empty list whose accumulator is the binding.
fn bind_macro(
    helper: &mut MacroExprHelper<'_>,
    target: &mut Option<IdedExpr>,
    args: &mut Vec<IdedExpr>,
) -> Result<Option<IdedExpr>, ParseError> {
    if !matches!(target.as_ref().map(|t| &t.expr), Some(Expr::Ident(name)) if name == "cel") {
        return Ok(None);
    }
    let (Some(body), Some(init), Some(var)) = (args.pop(), args.pop(), args.pop()) else {
        return Err(helper.new_error(0, "cel.bind takes three arguments"));
    };
    let Expr::Ident(name) = var.expr else {
        return Err(helper.new_error(
            var.id,
            "cel.bind() variable name must be a simple identifier",
        ));
    };
    let range = helper.next_expr(Expr::List(ListExpr::new(Vec::new())));
    let cond = helper.next_expr(Expr::Literal(LiteralValue::Boolean(CelBool::from(false))));
    let step = helper.next_expr(Expr::Ident(name.clone()));
    Ok(Some(helper.next_expr(Expr::Comprehension(Box::new(
        ComprehensionExpr {
            iter_range: range,
            iter_var: "#unused".to_owned(),
            iter_var2: None,
            accu_var: name,
            accu_init: init,
            loop_cond: cond,
            loop_step: step,
            result: body,
        },
    )))))
}
