//! The state machine's semantics, as containerd's snapshotter contract
//! documents them (Prepare, View, Commit, Remove, Stat, Update, Usage,
//! Walk; parent chains, kinds, errors, persistence), run without root over
//! a backend in memory. `tests/snapshotter_suite.rs` in the CLI runs the
//! same contract against the real backend, as root, through containerd's
//! API and real mounts.

use crate::backend::{Backend, Hold, Stored};
use crate::error::Error;
use crate::grpc::code;
use crate::layer::LayerUsage;
use crate::state::{self, Record, SnapKind};
use crate::{make_root, Tilefs};
use containerd_snapshots::api::types::Mount;
use containerd_snapshots::{Info, Kind};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tilefs_oci::lazy_index::LazyKind;
use tilefs_oci::pull::PullOptions;
use tilefs_oci::ImageRef;
use tonic::Code;

/// What the fake backend was asked and holds.
#[derive(Default)]
struct Seen {
    /// Held images, by snapshot id.
    images: HashMap<u64, String>,
    /// What each stored layer was stored over.
    chains: HashMap<u64, Vec<u64>>,
    mounted: HashMap<PathBuf, u64>,
    /// Images let go of with their objects to collect.
    collected: Vec<u64>,
    undone: Vec<u64>,
    /// Stores to fail, from now on.
    failing: usize,
    /// While set, a store waits.
    gate_closed: bool,
    /// Upper directories a live overlay has.
    in_use: HashSet<PathBuf>,
    next_image: u64,
}

/// A backend in memory: images are names, mounts are entries in a map.
#[derive(Default)]
struct Fake {
    seen: Mutex<Seen>,
    opened: Condvar,
    store: PathBuf,
}

impl Fake {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap()
    }

    fn open_gate(&self) {
        self.seen().gate_closed = false;
        self.opened.notify_all();
    }
}

/// The rig's backend: the test keeps its own reference to the fake.
struct Shared(Arc<Fake>);

impl Backend for Shared {
    fn store_layer(&self, id: u64, chain: &[u64]) -> crate::Result<Stored> {
        let mut seen = self.0.seen();
        while seen.gate_closed {
            seen = self.0.opened.wait(seen).unwrap();
        }
        if seen.failing > 0 {
            seen.failing -= 1;
            return Err(Error::Broken("the fake fails this store".into()));
        }
        seen.next_image += 1;
        let image = format!("{:064x}", seen.next_image);
        seen.images.insert(id, image.clone());
        seen.chains.insert(id, chain.to_vec());
        Ok(Stored {
            image,
            usage: LayerUsage { size: 4096, inodes: 1 },
        })
    }

    fn undo_store(&self, id: u64) -> crate::Result<()> {
        let mut seen = self.0.seen();
        seen.images.remove(&id);
        seen.undone.push(id);
        Ok(())
    }

    fn build_chain(&self, _id: u64, _kind: &LazyKind, _n: usize) -> crate::Result<(String, u64)> {
        Err(Error::Lazy("the fake serves nothing lazily".into()))
    }

    fn pull_lazy(&self, _id: u64, _reference: &ImageRef, _opts: &PullOptions) -> crate::Result<String> {
        Err(Error::Lazy("the fake serves nothing lazily".into()))
    }

    fn mount(&self, r: &Record, at: &Path) -> crate::Result<()> {
        let mut seen = self.0.seen();
        if !seen.images.contains_key(&r.id) {
            return Err(Error::Broken(format!("no image of snapshot {}", r.id)));
        }
        seen.mounted.insert(at.to_path_buf(), r.id);
        Ok(())
    }

    fn is_mounted(&self, at: &Path) -> bool {
        self.0.seen().mounted.contains_key(at)
    }

    fn needs_data_lower(&self, _at: &Path) -> bool {
        true
    }

    fn unmount(&self, at: &Path) {
        self.0.seen().mounted.remove(at);
    }

    fn release(&self, id: u64, collect: bool) -> crate::Result<()> {
        let mut seen = self.0.seen();
        if seen.images.remove(&id).is_some() && collect {
            seen.collected.push(id);
        }
        Ok(())
    }

    fn held(&self) -> crate::Result<Vec<u64>> {
        Ok(self.0.seen().images.keys().copied().collect())
    }

    fn hold_upper(&self, upper: &Path, _scratch: &Path) -> Option<Hold> {
        (!self.0.seen().in_use.contains(upper)).then(|| Box::new(()) as Hold)
    }

    fn sync(&self) -> crate::Result<()> {
        Ok(())
    }

    fn check_layer(&self, _id: u64) -> crate::Result<usize> {
        Ok(0)
    }

    fn data_lower(&self) -> &Path {
        &self.0.store
    }
}

struct Rig {
    dir: tempfile::TempDir,
    fake: Arc<Fake>,
    t: Tilefs,
}

fn no_labels() -> HashMap<String, String> {
    HashMap::new()
}

fn labels(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(Fake {
            store: dir.path().join("store"),
            ..Fake::default()
        });
        let t = Self::start(dir.path(), &fake);
        Rig { dir, fake, t }
    }

    fn start(dir: &Path, fake: &Arc<Fake>) -> Tilefs {
        let root = make_root(&dir.join("root")).unwrap();
        Tilefs::with_backend(root, Box::new(Shared(fake.clone())), None).unwrap()
    }

    /// A new snapshotter on the same root and backend, as after a restart.
    fn reopen(&mut self) {
        self.t = Self::start(self.dir.path(), &self.fake);
    }

    fn prepare_with(&self, key: &str, parent: &str, l: HashMap<String, String>) -> crate::Result<Vec<Mount>> {
        self.t.s.create(key.into(), parent.into(), l, SnapKind::Active)
    }

    fn prepare(&self, key: &str, parent: &str) -> crate::Result<Vec<Mount>> {
        self.prepare_with(key, parent, no_labels())
    }

    fn view_with(&self, key: &str, parent: &str, l: HashMap<String, String>) -> crate::Result<Vec<Mount>> {
        self.t.s.create(key.into(), parent.into(), l, SnapKind::View)
    }

    fn view(&self, key: &str, parent: &str) -> crate::Result<Vec<Mount>> {
        self.view_with(key, parent, no_labels())
    }

    fn commit_with(&self, name: &str, key: &str, l: HashMap<String, String>) -> crate::Result<()> {
        self.t.s.commit(name.into(), key.into(), l)
    }

    fn commit(&self, name: &str, key: &str) -> crate::Result<()> {
        self.commit_with(name, key, no_labels())
    }

    fn remove(&self, key: &str) -> crate::Result<()> {
        self.t.s.remove(key)
    }

    fn stat(&self, key: &str) -> crate::Result<Info> {
        self.t.s.stat(key)
    }

    fn walk(&self, filters: &[&str]) -> Vec<String> {
        let f: Vec<String> = filters.iter().map(|s| s.to_string()).collect();
        self.t.s.list(&f).unwrap().into_iter().map(|i| i.name).collect()
    }

    fn record(&self, key: &str) -> Record {
        self.t.s.lock().by_key[key].clone()
    }

    /// A committed chain `names` (each over the one before), each layer
    /// holding one file named after it, stored.
    fn chain(&self, names: &[&str]) {
        let mut parent = "";
        for n in names {
            let key = format!("{n}-active");
            let m = self.prepare(&key, parent).unwrap();
            std::fs::write(Path::new(option(&m, "upperdir")).join(n), n).unwrap();
            self.commit(n, &key).unwrap();
            parent = n;
        }
        for n in names {
            self.stored(n);
        }
    }

    /// Waits for the worker to store committed snapshot `key`.
    fn stored(&self, key: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.record(key).pending {
            assert!(Instant::now() < deadline, "{key} is still pending");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The value of overlay option `name` in the only mount of `m`.
fn option<'a>(m: &'a [Mount], name: &str) -> &'a str {
    assert_eq!(m.len(), 1, "{m:?}");
    m[0].options
        .iter()
        .find_map(|o| o.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {name} in {m:?}"))
}

/// An Update's request for snapshot `name`.
fn request(name: &str, parent: &str, l: &[(&str, &str)]) -> Info {
    Info {
        name: name.into(),
        parent: parent.into(),
        labels: labels(l),
        ..Info::default()
    }
}

fn has_option(m: &[Mount], name: &str) -> bool {
    m[0].options.iter().any(|o| o.starts_with(&format!("{name}=")))
}

fn code_of<T: std::fmt::Debug>(r: crate::Result<T>) -> Code {
    code(&r.expect_err("an error"))
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn a_layer_committed_is_the_parent_of_the_next_and_a_view_shows_the_chain() {
    let rig = Rig::new();
    let m = rig.prepare("unpack-1", "").unwrap();
    // No parent: an overlay over the empty directory, its upper the layer.
    assert_eq!(m[0].r#type, "overlay");
    assert!(option(&m, "lowerdir").ends_with("/empty"), "{m:?}");
    assert!(has_option(&m, "workdir"));
    let upper = PathBuf::from(option(&m, "upperdir"));
    std::fs::write(upper.join("foo"), "foo\n").unwrap();
    rig.commit("base", "unpack-1").unwrap();

    let base = rig.stat("base").unwrap();
    assert_eq!(
        (&base.kind, base.parent.as_str(), base.name.as_str()),
        (&Kind::Committed, "", "base")
    );
    assert_eq!(
        code_of(rig.stat("unpack-1")),
        Code::NotFound,
        "an active key is gone once committed"
    );

    let m = rig.prepare("unpack-2", "base").unwrap();
    let next = rig.stat("unpack-2").unwrap();
    assert_eq!((next.kind, next.parent.as_str()), (Kind::Active, "base"));
    // Over the parent's image, mounted, with the store as data-only lower.
    let base_id = rig.record("base").id;
    let mnt = state::mount_dir(rig.t.root(), base_id);
    assert_eq!(
        option(&m, "lowerdir"),
        format!("{}::{}", mnt.display(), rig.fake.store.display())
    );
    assert_eq!(rig.fake.seen().mounted.get(&mnt), Some(&base_id));
    assert!(has_option(&m, "upperdir") && has_option(&m, "workdir"));
    rig.commit("top", "unpack-2").unwrap();
    rig.stored("top");
    let top = rig.stat("top").unwrap();
    assert_eq!((&top.kind, top.parent.as_str()), (&Kind::Committed, "base"));
    // Its layer was stored over its parent's.
    let top_id = rig.record("top").id;
    assert_eq!(rig.fake.seen().chains[&top_id], vec![base_id]);

    // Walk shows both as Stat does.
    let all = rig.t.s.list(&[]).unwrap();
    for i in [&base, &top] {
        let w = all.iter().find(|w| w.name == i.name).expect("walked");
        assert_eq!((&w.kind, &w.parent, &w.labels), (&i.kind, &i.parent, &i.labels));
        assert_eq!((w.created_at, w.updated_at), (i.created_at, i.updated_at));
    }

    // A view: read-only, no upper directory.
    let v = rig.view("look", "top").unwrap();
    assert!(!has_option(&v, "upperdir") && !has_option(&v, "workdir"), "{v:?}");
    assert_eq!(rig.stat("look").unwrap().kind, Kind::View);
    rig.remove("look").unwrap();

    let e = rig.remove("base").unwrap_err();
    assert_eq!(code(&e), Code::FailedPrecondition);
    assert!(e.to_string().contains("remove"), "{e}");
    rig.remove("top").unwrap();
    rig.remove("base").unwrap();
    let seen = rig.fake.seen();
    assert!(
        seen.images.is_empty() && seen.mounted.is_empty(),
        "images and mounts let go of"
    );
    assert_eq!(seen.collected.len(), 2, "their objects handed to the collector");
}

#[test]
fn an_active_snapshot_without_parent_stats_as_active_and_its_root_is_0755() {
    let rig = Rig::new();
    let m = rig.prepare("fresh", "").unwrap();
    let i = rig.stat("fresh").unwrap();
    assert_eq!(
        (i.kind, i.name.as_str(), i.parent.as_str()),
        (Kind::Active, "fresh", "")
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(option(&m, "upperdir")).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o755);
}

#[test]
fn a_key_is_taken_once_whatever_the_kind() {
    let rig = Rig::new();
    rig.chain(&["c"]);
    rig.prepare("k", "c").unwrap();
    assert_eq!(code_of(rig.view("k", "c")), Code::AlreadyExists);
    assert_eq!(code_of(rig.prepare("k", "c")), Code::AlreadyExists);
    rig.view("v", "c").unwrap();
    assert_eq!(code_of(rig.view("v", "c")), Code::AlreadyExists);
    assert_eq!(
        code_of(rig.prepare("c", "")),
        Code::AlreadyExists,
        "a committed name too"
    );
    assert_eq!(code_of(rig.prepare("", "")), Code::InvalidArgument);
}

#[test]
fn a_parent_must_exist_and_be_committed() {
    let rig = Rig::new();
    assert_eq!(code_of(rig.prepare("k", "nowhere")), Code::NotFound);
    rig.prepare("active", "").unwrap();
    assert_eq!(code_of(rig.prepare("k", "active")), Code::InvalidArgument);
    assert_eq!(code_of(rig.view("v", "active")), Code::InvalidArgument);
    rig.view("view", "").unwrap();
    assert_eq!(code_of(rig.prepare("k", "view")), Code::InvalidArgument);
    // A refused create leaves nothing: the key is free.
    rig.prepare("k", "").unwrap();
}

#[test]
fn only_an_active_snapshot_is_committed_and_to_a_free_name() {
    let rig = Rig::new();
    rig.chain(&["c"]);
    rig.view("v", "c").unwrap();
    assert_eq!(code_of(rig.commit("x", "v")), Code::FailedPrecondition, "a view");
    assert_eq!(
        code_of(rig.commit("x", "c")),
        Code::FailedPrecondition,
        "a committed one"
    );
    assert_eq!(code_of(rig.commit("x", "missing")), Code::NotFound);
    rig.prepare("a", "c").unwrap();
    assert_eq!(code_of(rig.commit("c", "a")), Code::AlreadyExists);
    assert_eq!(code_of(rig.commit("", "a")), Code::InvalidArgument);
    // Still active after the refusals.
    assert_eq!(rig.stat("a").unwrap().kind, Kind::Active);
    rig.commit_with("d", "a", labels(&[("l", "1")])).unwrap();
    let d = rig.stat("d").unwrap();
    assert_eq!((d.kind, d.parent.as_str()), (Kind::Committed, "c"));
    assert_eq!(
        d.labels,
        labels(&[("l", "1")]),
        "the Commit's labels are the snapshot's"
    );
}

#[test]
fn a_snapshot_with_children_is_not_removed_and_a_missing_one_is_not_found() {
    let rig = Rig::new();
    rig.chain(&["a", "b", "c"]);
    rig.prepare("work", "c").unwrap();
    for parent in ["a", "b", "c"] {
        assert_eq!(code_of(rig.remove(parent)), Code::FailedPrecondition, "{parent}");
    }
    rig.remove("work").unwrap();
    assert_eq!(code_of(rig.remove("work")), Code::NotFound);
    for k in ["c", "b", "a"] {
        rig.remove(k).unwrap();
    }
    assert!(rig.walk(&[]).is_empty());
}

#[test]
fn removed_keys_and_names_are_free_again() {
    let rig = Rig::new();
    rig.chain(&["one"]);
    rig.prepare("again", "one").unwrap();
    rig.remove("again").unwrap();
    rig.view("again", "one").unwrap();
    rig.remove("again").unwrap();
    rig.prepare("again", "").unwrap();
    // A committed snapshot with no children goes while another is active,
    // and its name serves that one's Commit.
    rig.remove("one").unwrap();
    rig.commit("one", "again").unwrap();
    assert_eq!(rig.stat("one").unwrap().parent, "");
}

#[test]
fn mounts_are_those_of_active_snapshots_and_views() {
    let rig = Rig::new();
    rig.chain(&["c"]);
    assert_eq!(code_of(rig.t.s.mounts("c")), Code::FailedPrecondition);
    assert_eq!(code_of(rig.t.s.mounts("nope")), Code::NotFound);
    let made = rig.prepare("a", "c").unwrap();
    assert_eq!(
        rig.t.s.mounts("a").unwrap(),
        made,
        "Mounts again gives what Prepare gave"
    );
    // A view without parent: its own empty directory, read-only.
    let v = rig.view("v", "").unwrap();
    assert_eq!(v[0].r#type, "bind");
    assert!(v[0].options.contains(&"ro".to_string()));
}

#[test]
fn a_chain_is_mounted_through_its_top_image_alone() {
    let rig = Rig::new();
    rig.chain(&["l1", "l2", "l3"]);
    let ids: Vec<u64> = ["l1", "l2", "l3"].iter().map(|k| rig.record(k).id).collect();
    let seen = rig.fake.seen().chains.clone();
    assert_eq!(seen[&ids[1]], vec![ids[0]]);
    assert_eq!(seen[&ids[2]], vec![ids[0], ids[1]]);
    let m = rig.view("v", "l3").unwrap();
    let top = state::mount_dir(rig.t.root(), ids[2]);
    assert_eq!(
        option(&m, "lowerdir"),
        format!("{}::{}", top.display(), rig.fake.store.display())
    );
}

#[test]
fn update_changes_labels_alone_by_field_path() {
    let rig = Rig::new();
    let before = SystemTime::now();
    rig.chain(&["c1", "c2"]);
    rig.prepare("a1", "c2").unwrap();
    rig.prepare("a2", "").unwrap();
    rig.view("v1", "c2").unwrap();
    rig.view("v2", "").unwrap();
    let after = SystemTime::now();
    let cases = [
        ("c1", Kind::Committed, ""),
        ("c2", Kind::Committed, "c1"),
        ("a1", Kind::Active, "c2"),
        ("a2", Kind::Active, ""),
        ("v1", Kind::View, "c2"),
        ("v2", Kind::View, ""),
    ];
    for (name, kind, parent) in cases {
        let i = rig.stat(name).unwrap();
        assert!(i.created_at >= before && i.created_at <= after, "{name}");
        assert_eq!(i.created_at, i.updated_at, "{name}: not updated yet");
        let created = i.created_at;

        // No field paths: the labels are replaced; what else changed is not taken.
        let asked = Info {
            kind: Kind::View,
            ..request(name, "elsewhere", &[("a", "1"), ("b", "2"), ("keep", "x")])
        };
        let u0 = SystemTime::now();
        let got = rig.t.s.update(asked, None).unwrap();
        assert_eq!(
            (&got.kind, got.parent.as_str(), got.name.as_str()),
            (&kind, parent, name)
        );
        assert_eq!(got.created_at, created);
        assert!(got.updated_at >= u0, "{name}: updated now");
        assert_eq!(got.labels, labels(&[("a", "1"), ("b", "2"), ("keep", "x")]));

        // `labels.KEY`: that label set, or removed when the request has none.
        let asked = request(name, parent, &[("a", "changed"), ("c", "not asked for")]);
        let got = rig
            .t
            .s
            .update(asked, Some(vec!["labels.a".into(), "labels.b".into()]))
            .unwrap();
        assert_eq!(got.labels, labels(&[("a", "changed"), ("keep", "x")]), "{name}");

        // `labels`: all of them.
        let asked = request(name, parent, &[("only", "this")]);
        let got = rig.t.s.update(asked, Some(vec!["labels".into()])).unwrap();
        assert_eq!(got.labels, labels(&[("only", "this")]));
        assert_eq!(rig.stat(name).unwrap().labels, got.labels, "{name}: kept");

        // Any other field is refused, and nothing changes.
        let asked = request(name, "elsewhere", &[]);
        let e = rig.t.s.update(asked, Some(vec!["parent".into()])).unwrap_err();
        assert_eq!(code(&e), Code::InvalidArgument, "{name}: {e}");
        assert_eq!(rig.stat(name).unwrap().labels, got.labels);
    }
    assert_eq!(code_of(rig.t.s.update(request("gone", "", &[]), None)), Code::NotFound);
}

#[test]
fn walk_filters_by_kind_name_parent_and_labels() {
    let rig = Rig::new();
    let mine = || labels(&[("owner", "suite")]);
    let with = |l: &str| labels(&[("owner", "suite"), ("layer", l)]);
    rig.prepare_with("loose", "", mine()).unwrap();
    rig.prepare_with("base-active", "", mine()).unwrap();
    rig.commit_with("base", "base-active", mine()).unwrap();
    rig.prepare_with("work", "base", mine()).unwrap();
    rig.view_with("look", "base", mine()).unwrap();
    rig.prepare_with("tagged-active", "", mine()).unwrap();
    rig.commit_with("tagged", "tagged-active", with("one")).unwrap();
    rig.prepare_with("tagged-work", "tagged", with("two")).unwrap();
    rig.view_with("tagged-look", "tagged", with("three")).unwrap();
    rig.prepare_with("loose-tagged", "", with("two")).unwrap();
    rig.prepare("stranger", "").unwrap();

    let cases: &[(&[&str], &[&str])] = &[
        (
            &[],
            &[
                "base",
                "look",
                "loose",
                "loose-tagged",
                "stranger",
                "tagged",
                "tagged-look",
                "tagged-work",
                "work",
            ],
        ),
        (
            &["labels.owner==suite"],
            &[
                "base",
                "look",
                "loose",
                "loose-tagged",
                "tagged",
                "tagged-look",
                "tagged-work",
                "work",
            ],
        ),
        (
            &["kind==active,labels.owner==suite"],
            &["loose", "loose-tagged", "tagged-work", "work"],
        ),
        (&["kind==view"], &["look", "tagged-look"]),
        (&["kind==committed"], &["base", "tagged"]),
        // Filters are alternatives; selectors of one filter all apply.
        (&["name==base", "name==stranger"], &["base", "stranger"]),
        (&["name==tagged-work,labels.layer"], &["tagged-work"]),
        (&["name==work,labels.layer"], &[]),
        (&["parent==base"], &["look", "work"]),
        (
            &[r#"parent!="",labels.owner==suite"#],
            &["look", "tagged-look", "tagged-work", "work"],
        ),
        (
            &["labels.layer"],
            &["loose-tagged", "tagged", "tagged-look", "tagged-work"],
        ),
        (&["labels.layer==two"], &["loose-tagged", "tagged-work"]),
        (
            &[r#"labels."layer"~=^t"#],
            &["loose-tagged", "tagged-look", "tagged-work"],
        ),
        (&["labels.layer!=two,labels.layer"], &["tagged", "tagged-look"]),
    ];
    for (filters, want) in cases {
        assert_eq!(rig.walk(filters), sorted(want), "{filters:?}");
    }
    let e = rig.t.s.list(&["name==".into(), "labels.\"open".into()]).unwrap_err();
    assert_eq!(code(&e), Code::InvalidArgument, "{e}");
}

#[test]
fn usage_counts_an_active_layer_on_the_disk_and_a_committed_one_as_stored() {
    let rig = Rig::new();
    let m = rig.prepare("a", "").unwrap();
    let empty = rig.t.s.usage("a").unwrap();
    assert_eq!((empty.size, empty.inodes), (0, 0));
    let upper = Path::new(option(&m, "upperdir"));
    std::fs::create_dir(upper.join("d")).unwrap();
    std::fs::write(upper.join("d/f"), vec![7u8; 10_000]).unwrap();
    let u = rig.t.s.usage("a").unwrap();
    assert_eq!(u.inodes, 2);
    assert!(u.size >= 10_000, "{u:?}");
    rig.commit("c", "a").unwrap();
    rig.stored("c");
    let c = rig.t.s.usage("c").unwrap();
    assert_eq!((c.size, c.inodes), (4096, 1), "what the backend stored");
    assert_eq!(code_of(rig.t.s.usage("a")), Code::NotFound);
}

#[test]
fn a_restart_finds_every_snapshot_as_it_was_and_makes_no_id_twice() {
    let mut rig = Rig::new();
    rig.chain(&["c1", "c2"]);
    rig.prepare_with("a", "c2", labels(&[("k", "v")])).unwrap();
    rig.view("v", "c1").unwrap();
    rig.t.s.update(request("c1", "", &[("gc", "root")]), None).unwrap();
    let before: Vec<Info> = rig.t.s.list(&[]).unwrap();
    let ids: HashSet<u64> = ["c1", "c2", "a", "v"].iter().map(|k| rig.record(k).id).collect();
    rig.reopen();
    let after = rig.t.s.list(&[]).unwrap();
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        assert_eq!(
            (&b.name, &b.kind, &b.parent, &b.labels, b.created_at, b.updated_at),
            (&a.name, &a.kind, &a.parent, &a.labels, a.created_at, a.updated_at)
        );
    }
    // The chain's images are still held; new snapshots get new ids.
    assert_eq!(rig.fake.seen().images.len(), 2);
    rig.prepare("new", "c2").unwrap();
    assert!(!ids.contains(&rig.record("new").id));
    rig.commit("c3", "a").unwrap();
    rig.stored("c3");
    rig.remove("v").unwrap();
}

#[test]
fn a_start_removes_what_no_record_accounts_for() {
    let mut rig = Rig::new();
    rig.chain(&["c"]);
    let root = rig.t.root().to_path_buf();
    // A snapshot directory, a mount point and an image left by a crash.
    let stray = state::snapshot_dir(&root, 900);
    std::fs::create_dir_all(stray.join("fs")).unwrap();
    let mnt = state::mount_dir(&root, 901);
    std::fs::create_dir_all(&mnt).unwrap();
    rig.fake.seen().images.insert(902, "f".repeat(64));
    rig.reopen();
    assert!(!stray.exists() && !mnt.exists());
    let seen = rig.fake.seen();
    assert!(!seen.images.contains_key(&902) && seen.images.contains_key(&rig.record("c").id));
    assert!(seen.collected.contains(&902));
}

#[test]
fn a_committed_upper_directory_goes_once_stored_unless_a_live_overlay_has_it() {
    let rig = Rig::new();
    rig.chain(&["gone"]);
    let dir = state::snapshot_dir(rig.t.root(), rig.record("gone").id);
    // The reap after the store removed the upper and work directories.
    let deadline = Instant::now() + Duration::from_secs(10);
    while dir.join("fs").exists() || dir.join("work").exists() {
        assert!(
            Instant::now() < deadline,
            "{} still has its upper directory",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    let m = rig.prepare("busy-active", "").unwrap();
    let upper = PathBuf::from(option(&m, "upperdir"));
    rig.fake.seen().in_use.insert(upper.clone());
    rig.commit("busy", "busy-active").unwrap();
    rig.stored("busy");
    rig.t.s.reap();
    assert!(upper.exists(), "a live overlay's upper directory is left to it");
    rig.fake.seen().in_use.clear();
    // Removed later, once free (a Remove reaps, as does the next start).
    rig.remove("busy").unwrap();
    assert!(!upper.exists());
}

#[test]
fn an_unpack_is_mounted_over_layers_not_stored_yet_and_anything_else_waits() {
    let rig = Rig::new();
    rig.fake.seen().gate_closed = true;
    let m = rig.prepare("extract-1 sha256:aa", "").unwrap();
    let pending_upper = option(&m, "upperdir").to_string();
    rig.commit("sha256:aa", "extract-1 sha256:aa").unwrap();
    assert!(rig.record("sha256:aa").pending);

    // containerd's unpacker names the snapshot to commit in a label: its
    // Prepare gets the pending upper directory as a lower one at once.
    let unpack = labels(&[("containerd.io/snapshot.ref", "sha256:bb")]);
    let over_pending = format!("{pending_upper}::{}", rig.fake.store.display());
    let m = rig.prepare_with("k8s.io/3/unpack", "sha256:aa", unpack).unwrap();
    assert_eq!(option(&m, "lowerdir"), over_pending);
    // Its older path says so by the key alone.
    let m = rig.prepare("extract-2 sha256:cc", "sha256:aa").unwrap();
    assert_eq!(option(&m, "lowerdir"), over_pending);

    // A container's waits for the layer to be stored.
    let (tx, rx) = std::sync::mpsc::channel();
    let s = rig.t.s.clone();
    std::thread::spawn(move || {
        let _ = tx.send(s.create("container".into(), "sha256:aa".into(), no_labels(), SnapKind::Active));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "answered before the layer was stored"
    );
    rig.fake.open_gate();
    let m = rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    let mnt = state::mount_dir(rig.t.root(), rig.record("sha256:aa").id);
    assert_eq!(
        option(&m, "lowerdir"),
        format!("{}::{}", mnt.display(), rig.fake.store.display())
    );
    // The unpacks' lowers stay until they are gone.
    assert!(Path::new(&pending_upper).exists());
    rig.remove("k8s.io/3/unpack").unwrap();
    rig.remove("extract-2 sha256:cc").unwrap();
    rig.t.s.reap();
    assert!(!Path::new(&pending_upper).exists());
}

#[test]
fn a_layer_that_fails_to_store_is_tried_again_then_named_in_the_error() {
    let rig = Rig::new();
    rig.fake.seen().failing = 1;
    let m = rig.prepare("a", "").unwrap();
    std::fs::write(Path::new(option(&m, "upperdir")).join("f"), "x").unwrap();
    rig.commit("c", "a").unwrap();
    // The first store fails; a Prepare over it asks again, which works.
    rig.prepare("over", "c").unwrap();
    assert!(!rig.record("c").pending);
    assert!(
        rig.fake.seen().undone.contains(&rig.record("c").id),
        "its files given back first"
    );

    rig.fake.seen().failing = usize::MAX;
    rig.prepare("b", "").unwrap();
    rig.commit("d", "b").unwrap();
    let e = rig.prepare("over-d", "d").unwrap_err();
    assert_eq!(code(&e), Code::Internal);
    assert!(e.to_string().contains("could not be stored"), "{e}");
    assert_eq!(code_of(rig.stat("over-d")), Code::NotFound, "no mounts, no snapshot");
}

#[test]
fn each_error_reaches_containerd_with_its_code() {
    let io = || std::io::Error::from(std::io::ErrorKind::PermissionDenied);
    let cases = [
        (Error::NotFound("k".into()), Code::NotFound),
        (Error::ParentNotFound("p".into()), Code::NotFound),
        (Error::AlreadyExists("k".into()), Code::AlreadyExists),
        (Error::ServedLazily("k".into()), Code::AlreadyExists),
        (Error::Empty("key"), Code::InvalidArgument),
        (Error::ParentNotCommitted("p".into()), Code::InvalidArgument),
        (Error::NotActive("k".into()), Code::FailedPrecondition),
        (Error::NoMounts("k".into()), Code::FailedPrecondition),
        (Error::Lazy("registry".into()), Code::Unavailable),
        (Error::io("/x", "cannot read", io()), Code::Internal),
        (Error::NotFound("k".into()).context("while doing this"), Code::NotFound),
    ];
    for (e, want) in cases {
        assert_eq!(code(&e), want, "{e}");
        let s = tonic::Status::from(e);
        assert_eq!(s.code(), want);
    }
}
