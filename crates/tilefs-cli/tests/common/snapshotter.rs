//! The snapshotter spoken to directly over its gRPC API, as containerd
//! speaks it: started on a socket of a test's directory, stopped (and
//! everything mounted below the directory taken down) on drop.

use super::oci::checked as ok;
use super::*;
use containerd_snapshots::api::snapshots::v1::snapshots_client::SnapshotsClient;
use containerd_snapshots::api::snapshots::v1::{
    CommitSnapshotRequest, Info, ListSnapshotsRequest, MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest,
    StatSnapshotRequest, UpdateSnapshotRequest, ViewSnapshotRequest,
};
use containerd_snapshots::api::types::Mount;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use tonic::transport::Channel;
use tonic::Code;

/// The label containerd's unpacker names the snapshot to commit in.
pub const TARGET: &str = "containerd.io/snapshot.ref";

/// The snapshotter on a socket of the test's directory; on drop it is
/// stopped and everything mounted below the directory is taken down.
pub struct Snap {
    pub area: PathBuf,
    pub sock: PathBuf,
    child: Option<Child>,
    pub rt: tokio::runtime::Runtime,
    /// The snapshotter's arguments besides root, store and socket.
    args: Vec<String>,
}

impl Snap {
    pub fn start(area: &Path) -> Snap {
        Snap::start_with(area, &[])
    }

    /// With `tilefs snapshotter` given `args` too.
    pub fn start_with(area: &Path, args: &[&str]) -> Snap {
        let mut s = Snap {
            area: area.to_path_buf(),
            sock: area.join("s.sock"),
            child: None,
            args: ["--tls-verify=false"]
                .iter()
                .chain(args)
                .map(|a| a.to_string())
                .collect(),
            // Its own thread drives the connections, which close as the
            // clients go.
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap(),
        };
        s.run();
        s
    }

    /// Started under the sandbox of contrib/systemd's unit, as
    /// scripts/unit-sandbox applies it: the lazy path must work there.
    pub fn run(&mut self) {
        let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let (sandbox, unit) = (
            top.join("scripts/unit-sandbox"),
            top.join("contrib/systemd/tilefs-snapshotter.service"),
        );
        self.child = Some(super::spawn_snapshotter_under(
            &[sandbox.as_os_str(), unit.as_os_str(), OsStr::new("--")],
            &self.area.join("root"),
            &self.area.join("store"),
            &self.sock,
            &self.args.iter().map(String::as_str).collect::<Vec<_>>(),
            &self.area.join("snapshotter.log"),
        ));
    }

    /// The committed snapshot containerd finds after a Prepare answered
    /// AlreadyExists: it walks for the chain ID label and the parent.
    pub fn walk(&self, target: &str, parent: &str) -> Option<String> {
        let mut c = self.client();
        let filter = format!("labels.\"{TARGET}\"=={target},parent==\"{parent}\"");
        self.rt.block_on(async {
            let mut stream = c
                .list(ListSnapshotsRequest {
                    snapshotter: "tilefs".into(),
                    filters: vec![filter],
                })
                .await
                .unwrap()
                .into_inner();
            let mut found = None;
            while let Some(page) = stream.message().await.unwrap() {
                for i in page.info {
                    if found.is_none() && i.kind == 3 && i.labels.get(TARGET).map(String::as_str) == Some(target) {
                        found = Some(i.name);
                    }
                }
            }
            found
        })
    }

    pub fn stop(&mut self) {
        super::stop_child(&mut self.child, "-TERM");
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.area.join("snapshotter.log")).unwrap_or_default()
    }

    pub fn client(&self) -> SnapshotsClient<Channel> {
        let sock = self.sock.clone();
        self.rt.block_on(async move {
            let ch = tonic::transport::Endpoint::try_from("http://snapshotter")
                .unwrap()
                .connect_with_connector(tower::service_fn(move |_| {
                    tokio::net::UnixStream::connect(sock.clone())
                }))
                .await
                .unwrap();
            SnapshotsClient::new(ch)
        })
    }

    /// The options of the mount Prepare returned (a bind mount, for a
    /// snapshot without parent, gives none).
    pub fn prepare(&self, key: &str, parent: &str, labels: HashMap<String, String>) -> Result<Vec<String>, Failed> {
        self.prepare_mounts(key, parent, labels).map(|m| {
            if parent.is_empty() {
                Vec::new()
            } else {
                overlay_options(&m)
            }
        })
    }

    /// The one mount of a view: (type, source, options).
    pub fn view(&self, key: &str, parent: &str) -> (String, String, Vec<String>) {
        let mut c = self.client();
        let r = self.rt.block_on(c.view(ViewSnapshotRequest {
            snapshotter: "tilefs".into(),
            key: key.into(),
            parent: parent.into(),
            labels: HashMap::new(),
        }));
        let m = r
            .unwrap_or_else(|e| panic!("view {key}: {e}\n{}", self.log()))
            .into_inner()
            .mounts;
        assert_eq!(m.len(), 1, "{m:?}");
        (m[0].r#type.clone(), m[0].source.clone(), m[0].options.clone())
    }

    pub fn mounts(&self, key: &str) -> (String, String, Vec<String>) {
        let mut c = self.client();
        let r = self.rt.block_on(c.mounts(MountsRequest {
            snapshotter: "tilefs".into(),
            key: key.into(),
        }));
        let m = r.unwrap().into_inner().mounts;
        (m[0].r#type.clone(), m[0].source.clone(), m[0].options.clone())
    }

    /// (kind, labels) of snapshot `key`, or the error's code.
    pub fn stat(&self, key: &str) -> Result<(i32, HashMap<String, String>), Code> {
        let mut c = self.client();
        self.rt
            .block_on(c.stat(StatSnapshotRequest {
                snapshotter: "tilefs".into(),
                key: key.into(),
            }))
            .map(|r| {
                let i = r.into_inner().info.unwrap();
                (i.kind, i.labels)
            })
            .map_err(|e| e.code())
    }

    pub fn commit(&self, name: &str, key: &str) -> Result<(), Failed> {
        let mut c = self.client();
        self.rt
            .block_on(c.commit(CommitSnapshotRequest {
                snapshotter: "tilefs".into(),
                name: name.into(),
                key: key.into(),
                labels: HashMap::new(),
            }))
            .map_err(failed)
            .map(|_| ())
    }

    pub fn remove(&self, key: &str) {
        let mut c = self.client();
        if let Err(e) = self.rt.block_on(c.remove(RemoveSnapshotRequest {
            snapshotter: "tilefs".into(),
            key: key.into(),
        })) {
            panic!("remove {key}: {e}");
        }
    }
}

/// The rest of containerd's calls, each call's answer whole.
impl Snap {
    pub fn prepare_mounts(
        &self,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, Failed> {
        let mut c = self.client();
        self.rt
            .block_on(c.prepare(PrepareSnapshotRequest {
                snapshotter: "tilefs".into(),
                key: key.into(),
                parent: parent.into(),
                labels,
            }))
            .map(|r| r.into_inner().mounts)
            .map_err(failed)
    }

    pub fn view_mounts(&self, key: &str, parent: &str) -> Result<Vec<Mount>, Failed> {
        let mut c = self.client();
        self.rt
            .block_on(c.view(ViewSnapshotRequest {
                snapshotter: "tilefs".into(),
                key: key.into(),
                parent: parent.into(),
                labels: HashMap::new(),
            }))
            .map(|r| r.into_inner().mounts)
            .map_err(failed)
    }

    pub fn try_remove(&self, key: &str) -> Result<(), Failed> {
        let mut c = self.client();
        self.rt
            .block_on(c.remove(RemoveSnapshotRequest {
                snapshotter: "tilefs".into(),
                key: key.into(),
            }))
            .map(drop)
            .map_err(failed)
    }

    pub fn info(&self, key: &str) -> Result<Info, Failed> {
        let mut c = self.client();
        self.rt
            .block_on(c.stat(StatSnapshotRequest {
                snapshotter: "tilefs".into(),
                key: key.into(),
            }))
            .map(|r| r.into_inner().info.expect("Stat gives an Info"))
            .map_err(failed)
    }

    pub fn update(&self, info: Info, paths: &[&str]) -> Result<Info, Failed> {
        let mut c = self.client();
        self.rt
            .block_on(c.update(UpdateSnapshotRequest {
                snapshotter: "tilefs".into(),
                info: Some(info),
                update_mask: Some(prost_types::FieldMask {
                    paths: paths.iter().map(|p| p.to_string()).collect(),
                }),
            }))
            .map(|r| r.into_inner().info.expect("Update gives an Info"))
            .map_err(failed)
    }

    /// The names Walk gives for `filters`, sorted.
    pub fn walk_names(&self, filters: &[&str]) -> Vec<String> {
        let mut c = self.client();
        let mut names = self.rt.block_on(async {
            let mut stream = c
                .list(ListSnapshotsRequest {
                    snapshotter: "tilefs".into(),
                    filters: filters.iter().map(|f| f.to_string()).collect(),
                })
                .await
                .unwrap()
                .into_inner();
            let mut names = Vec::new();
            while let Some(page) = stream.message().await.unwrap() {
                names.extend(page.info.into_iter().map(|i| i.name));
            }
            names
        });
        names.sort();
        names
    }
}

/// Mounts what Prepare or View gave (one overlay or bind mount) at `at`.
pub fn mount_all(mounts: &[Mount], at: &Path) -> Mounted {
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    let m = &mounts[0];
    fs::create_dir_all(at).unwrap();
    let mut cmd = Command::new("mount");
    match m.r#type.as_str() {
        "bind" => cmd.arg("--rbind"),
        t => cmd.args(["-t", t]),
    };
    let options: Vec<&str> = m.options.iter().map(String::as_str).filter(|o| *o != "rbind").collect();
    if !options.is_empty() {
        cmd.args(["-o", &options.join(",")]);
    }
    ok(cmd.arg(&m.source).arg(at));
    Mounted(at.to_path_buf())
}

impl Drop for Snap {
    fn drop(&mut self) {
        self.stop();
        // Deepest first: overlays over the FUSE mounts.
        let mut under: Vec<String> = mountinfo_lines()
            .iter()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .filter(|m| Path::new(m).starts_with(&self.area))
            .collect();
        under.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in under {
            Mounted(PathBuf::from(m)).unmount();
        }
    }
}

/// A call's error: its code and message.
pub type Failed = (Code, String);

pub fn failed(s: tonic::Status) -> Failed {
    (s.code(), s.message().to_string())
}

/// The options of the one overlay mount Mounts returned.
pub fn overlay_options(mounts: &[containerd_snapshots::api::types::Mount]) -> Vec<String> {
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0].r#type, "overlay", "{mounts:?}");
    mounts[0].options.clone()
}

pub fn mount_overlay(options: &[String], at: &Path) -> Mounted {
    fs::create_dir_all(at).unwrap();
    ok(Command::new("mount")
        .args(["-t", "overlay", "overlay", "-o", &options.join(",")])
        .arg(at));
    Mounted(at.to_path_buf())
}

/// The type of the filesystem of the mount a Mounts answer stacks on: a
/// bind mount's source, or an overlay's first lower directory.
pub fn fstype_below(mounts: &[Mount]) -> String {
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    let m = &mounts[0];
    let below = match m.r#type.as_str() {
        "bind" => m.source.clone(),
        _ => m
            .options
            .iter()
            .find_map(|o| o.strip_prefix("lowerdir="))
            .and_then(|l| l.split(':').next())
            .unwrap_or_default()
            .to_string(),
    };
    let line = mount_line(Path::new(&below)).unwrap_or_else(|| panic!("nothing mounted at {below}"));
    line.split(" - ").nth(1).unwrap().split(' ').next().unwrap().to_string()
}

/// Whether a Mounts answer reads a lazy image through the kernel: one
/// overlay over the image's EROFS mount with the store as its data-only
/// lower (not over a FUSE server's mount).
pub fn kernel_served(mounts: &[Mount]) -> bool {
    mounts.len() == 1
        && mounts[0].r#type == "overlay"
        && mounts[0]
            .options
            .iter()
            .any(|o| o.starts_with("lowerdir=") && o.contains("::"))
        && fstype_below(mounts) == "erofs"
}
