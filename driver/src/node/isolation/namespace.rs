//! The probe child's mount namespace, decided purely.
//!
//! A container gets its claim's CDI bind mounts from its runtime. The probe child gets them
//! from the plugin's own binary: `tessera-kubelet-plugin isolation-probe` started with
//! [`arguments`] (`--bind SOURCE TARGET OPTIONS` per mount, then `--` and the probe's command)
//! reads them back with [`parse`], makes a mount namespace of its own and applies [`plan`]'s
//! [`Step`]s in Rust, then replaces itself with the probe's command. No shell, `unshare` or
//! `mount` binary is involved (the plugin's image has none), and every path travels as an
//! argument of its own, never inside a script.
//!
//! Only bind mounts are applied: a mount's options must say `bind` or `rbind`; `ro`, `rw`,
//! `nosuid`, `nodev` and `noexec` become the bind's per-mount flags, as a runtime sets them.
//! Anything else is refused by name, so the probe fails closed instead of running in an
//! environment no container would get.

use crate::node::cdi::Mount;
pub use crate::node::mps_exec::PlanError;
use crate::node::mps_exec::{Step, checked};

/// The argument that starts one bind mount: `--bind SOURCE TARGET OPTIONS` (options joined
/// with `,`; CDI's options never hold one).
pub const BIND: &str = "--bind";
/// The argument after which the probe's command follows.
pub const COMMAND: &str = "--";

/// What the `isolation-probe` subcommand is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invocation {
    /// Run the probe itself, in this process (no arguments).
    Probe,
    /// Apply `binds` in a mount namespace of its own, then replace itself with `command`.
    Contained {
        /// The claim's bind mounts, in the spec's order.
        binds: Vec<Mount>,
        /// The program (an absolute path) and its arguments.
        command: Vec<String>,
    },
}

/// The arguments (after the subcommand) that run `program args` with `mounts` applied.
pub fn arguments(mounts: &[Mount], program: &str, args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(mounts.len() * 4 + args.len() + 2);
    for m in mounts {
        let mut options = m.options.clone();
        let says_bind = options.iter().any(|o| o == "bind" || o == "rbind");
        if m.mount_type.as_deref() == Some("bind") && !says_bind {
            options.push("bind".to_owned());
        }
        out.push(BIND.to_owned());
        out.push(m.host_path.clone());
        out.push(m.container_path.clone());
        out.push(options.join(","));
    }
    out.push(COMMAND.to_owned());
    out.push(program.to_owned());
    out.extend(args.iter().cloned());
    out
}

fn refused(value: &str, rule: &'static str) -> PlanError {
    PlanError {
        argument: BIND,
        value: value.to_owned(),
        rule,
    }
}

/// The bind mount of `source` at `target` with `options` as the arguments write them
/// (comma-separated, as in a CDI spec's mount).
fn bind_mount(source: &str, target: &str, options: &str) -> Mount {
    Mount {
        host_path: source.to_owned(),
        container_path: target.to_owned(),
        options: options
            .split(',')
            .filter(|o| !o.is_empty())
            .map(str::to_owned)
            .collect(),
        mount_type: None,
    }
}

/// Reads the subcommand's arguments back (what [`arguments`] wrote, or nothing).
pub fn parse(args: &[String]) -> Result<Invocation, PlanError> {
    if args.is_empty() {
        return Ok(Invocation::Probe);
    }
    let mut binds = Vec::new();
    let mut rest = args;
    loop {
        match rest {
            [flag, source, target, options, tail @ ..] if flag == BIND => {
                binds.push(bind_mount(source, target, options));
                rest = tail;
            }
            [flag, ..] if flag == BIND => {
                return Err(refused(
                    &rest.join(" "),
                    "needs a source, a target and its options",
                ));
            }
            [sep, program, tail @ ..] if sep == COMMAND => {
                checked(COMMAND, program)?;
                let mut command = vec![program.clone()];
                command.extend(tail.iter().cloned());
                return Ok(Invocation::Contained { binds, command });
            }
            [sep] if sep == COMMAND => {
                return Err(PlanError {
                    argument: COMMAND,
                    value: args.join(" "),
                    rule: "must be followed by the program the mounts are for",
                });
            }
            [] => {
                return Err(PlanError {
                    argument: COMMAND,
                    value: args.join(" "),
                    rule: "must end the mounts, followed by the program they are for",
                });
            }
            [other, ..] => {
                return Err(PlanError {
                    argument: "isolation-probe",
                    value: other.clone(),
                    rule: "is not an argument of the probe (--bind SOURCE TARGET OPTIONS ... \
                           -- PROGRAM ARGS)",
                });
            }
        }
    }
}

/// One bind mount, with whether its source is a directory (the child looks, before it plans).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    /// The mount, as the spec states it.
    pub mount: Mount,
    /// Whether the source is a directory (else a file: its mount point is an empty file).
    pub source_is_dir: bool,
}

/// The flags a mount's options ask for.
#[derive(Debug, Default)]
#[allow(clippy::struct_excessive_bools)] // one per mount flag, as the kernel has them
struct Flags {
    bind: bool,
    recursive: bool,
    read_only: bool,
    nosuid: bool,
    nodev: bool,
    noexec: bool,
}

fn flags(options: &[String]) -> Result<Flags, PlanError> {
    let mut f = Flags::default();
    for option in options {
        match option.as_str() {
            "bind" => f.bind = true,
            "rbind" => {
                f.bind = true;
                f.recursive = true;
            }
            "ro" => f.read_only = true,
            "rw" => f.read_only = false,
            "nosuid" => f.nosuid = true,
            "nodev" => f.nodev = true,
            "noexec" => f.noexec = true,
            _ => {
                return Err(refused(
                    option,
                    "is not a mount option the probe applies (bind, rbind, ro, rw, nosuid, \
                     nodev, noexec)",
                ));
            }
        }
    }
    if !f.bind {
        return Err(refused(
            &options.join(","),
            "must hold bind or rbind: the probe applies bind mounts only",
        ));
    }
    Ok(f)
}

/// The directory `path` (absolute, checked) is in.
fn parent(path: &str) -> String {
    match path.rsplit_once('/') {
        Some(("", _)) | None => "/".to_owned(),
        Some((dir, _)) => dir.to_owned(),
    }
}

/// The steps that give the probe `binds`, in order: a private mount namespace, then for each
/// mount its mount point (a directory, or an empty file in its created directory), the bind,
/// and its flags.
pub fn plan(binds: &[Bind]) -> Result<Vec<Step>, PlanError> {
    let mut steps = vec![Step::NewMountNamespace, Step::MakePrivate];
    for b in binds {
        let source = checked(BIND, &b.mount.host_path)?;
        let target = checked(BIND, &b.mount.container_path)?;
        if target == "/" {
            return Err(refused(&target, "must not be `/`"));
        }
        let f = flags(&b.mount.options)?;
        if b.source_is_dir {
            steps.push(Step::CreateDir(target.clone()));
        } else {
            steps.push(Step::CreateDir(parent(&target)));
            steps.push(Step::CreateFile(target.clone()));
        }
        steps.push(Step::Bind {
            source,
            target: target.clone(),
            recursive: f.recursive,
        });
        if f.read_only || f.nosuid || f.nodev || f.noexec {
            steps.push(Step::Remount {
                target,
                read_only: f.read_only,
                nosuid: f.nosuid,
                nodev: f.nodev,
                noexec: f.noexec,
            });
        }
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| (*a).to_owned()).collect()
    }

    #[test]
    fn the_arguments_read_back_as_the_mounts_and_the_command() {
        let mounts = [
            bind_mount(
                "/run/tessera/mps/m/pipe",
                "/tmp/nvidia-mps",
                "rw,nosuid,nodev,noexec,bind",
            ),
            // A path with a space and a quote stays one argument: nothing is ever a script.
            bind_mount("/var/lib/it's here", "/opt/x y", "rbind"),
        ];
        let args = arguments(&mounts, "/plugin", &strings(&["isolation-probe"]));
        assert_eq!(
            args,
            strings(&[
                "--bind",
                "/run/tessera/mps/m/pipe",
                "/tmp/nvidia-mps",
                "rw,nosuid,nodev,noexec,bind",
                "--bind",
                "/var/lib/it's here",
                "/opt/x y",
                "rbind",
                "--",
                "/plugin",
                "isolation-probe",
            ])
        );
        assert_eq!(
            parse(&args).unwrap(),
            Invocation::Contained {
                binds: mounts.to_vec(),
                command: strings(&["/plugin", "isolation-probe"]),
            }
        );
        assert_eq!(parse(&[]).unwrap(), Invocation::Probe);
        // A CDI mount that says `type: bind` instead of the option is still a bind.
        let mut typed = bind_mount("/a", "/b", "ro");
        typed.mount_type = Some("bind".to_owned());
        let Invocation::Contained { binds, .. } = parse(&arguments(&[typed], "/p", &[])).unwrap()
        else {
            panic!("contained");
        };
        assert_eq!(binds[0].options, ["ro", "bind"]);
    }

    #[test]
    fn bad_arguments_are_refused_by_name() {
        let err = parse(&strings(&["--bind", "/a", "/b"])).unwrap_err();
        assert_eq!(err.argument, BIND);
        assert!(
            err.to_string().contains("needs a source, a target"),
            "{err}"
        );
        let err = parse(&strings(&["--bind", "/a", "/b", "bind"])).unwrap_err();
        assert_eq!(err.argument, COMMAND, "{err}");
        let err = parse(&strings(&["--", "plugin", "isolation-probe"])).unwrap_err();
        assert!(err.to_string().contains("absolute"), "{err}");
        let err = parse(&strings(&["--verbose"])).unwrap_err();
        assert!(
            err.to_string().contains("\"--verbose\" is not an argument"),
            "{err}"
        );
        let err = parse(&strings(&["--bind", "/a", "/b", "bind", "--"])).unwrap_err();
        assert!(err.to_string().contains("followed by the program"), "{err}");
    }

    fn bind(source: &str, target: &str, options: &str, source_is_dir: bool) -> Bind {
        Bind {
            mount: bind_mount(source, target, options),
            source_is_dir,
        }
    }

    #[test]
    fn directories_and_files_get_their_mount_points_then_the_bind_and_its_flags() {
        let steps = plan(&[
            bind(
                "/run/tessera/hami/c/",
                "/tmp/vgpu",
                "rw,nosuid,nodev,noexec,bind",
                true,
            ),
            bind(
                "/usr/local/vgpu/libvgpu.so",
                "/usr/local/tessera/hami/libvgpu.so",
                "ro,nosuid,nodev,bind",
                false,
            ),
            bind("/dev", "/opt/dev", "rbind", true),
        ])
        .unwrap();
        assert_eq!(
            steps,
            [
                Step::NewMountNamespace,
                Step::MakePrivate,
                Step::CreateDir("/tmp/vgpu".to_owned()),
                Step::Bind {
                    source: "/run/tessera/hami/c".to_owned(),
                    target: "/tmp/vgpu".to_owned(),
                    recursive: false,
                },
                Step::Remount {
                    target: "/tmp/vgpu".to_owned(),
                    read_only: false,
                    nosuid: true,
                    nodev: true,
                    noexec: true,
                },
                Step::CreateDir("/usr/local/tessera/hami".to_owned()),
                Step::CreateFile("/usr/local/tessera/hami/libvgpu.so".to_owned()),
                Step::Bind {
                    source: "/usr/local/vgpu/libvgpu.so".to_owned(),
                    target: "/usr/local/tessera/hami/libvgpu.so".to_owned(),
                    recursive: false,
                },
                Step::Remount {
                    target: "/usr/local/tessera/hami/libvgpu.so".to_owned(),
                    read_only: true,
                    nosuid: true,
                    nodev: true,
                    noexec: false,
                },
                Step::CreateDir("/opt/dev".to_owned()),
                Step::Bind {
                    source: "/dev".to_owned(),
                    target: "/opt/dev".to_owned(),
                    recursive: true,
                },
            ]
        );
        assert_eq!(
            plan(&[bind("/f", "/top-level-file", "bind", false)]).unwrap()[2],
            Step::CreateDir("/".to_owned())
        );
    }

    #[test]
    fn mounts_the_probe_cannot_apply_as_a_runtime_would_are_refused_by_name() {
        let err = plan(&[bind("/a", "/b", "ro,rprivate,bind", true)]).unwrap_err();
        assert_eq!(err.value, "rprivate");
        assert!(err.to_string().contains("is not a mount option"), "{err}");
        let err = plan(&[bind("tmpfs", "/b", "nosuid", true)]).unwrap_err();
        assert!(err.to_string().contains("absolute"), "{err}");
        let err = plan(&[bind("/a", "/b", "nosuid", true)]).unwrap_err();
        assert!(err.to_string().contains("bind mounts only"), "{err}");
        let err = plan(&[bind("/a", "/x/../etc", "bind", true)]).unwrap_err();
        assert!(err.to_string().contains(".."), "{err}");
        let err = plan(&[bind("/a", "/", "bind", true)]).unwrap_err();
        assert!(err.to_string().contains("must not be `/`"), "{err}");
    }
}
