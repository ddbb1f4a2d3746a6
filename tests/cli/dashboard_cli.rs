//! `/dashboard` in a real browser: headless Chromium renders the page that `pagedweight serve
//! --fast` serves while requests run, and the heat map's cells it draws are the page table's.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The browser: Debian's `chromium` (installed by `.ci/run`).
fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!("no Chromium on PATH: install Debian's chromium package (.ci/run does)");
}

/// One HTTP/1.1 exchange; returns the status code and the body.
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default();
    (status, body)
}

fn page_table(addr: &str) -> Value {
    let (status, body) = http(addr, "GET", "/v1/page-table", None);
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The DOM Chromium renders for `url` after a few seconds of (virtual) time: the page has
/// polled the page table and drawn it.
fn rendered_dom(url: &str, profile: &Path) -> String {
    let o = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--virtual-time-budget=4000", "--dump-dom", url])
        .output()
        .unwrap();
    assert!(o.status.success(), "chromium: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// The heat maps' cells: (layer, expert, kind) → committed bits, from their data attributes.
fn cells(dom: &str) -> BTreeMap<(u64, u64, String), u64> {
    let attr = |el: &str, name: &str| -> Option<String> {
        let start = el.find(&format!("{name}=\""))? + name.len() + 2;
        Some(el[start..].split('"').next()?.to_string())
    };
    dom.split("<div class=\"cell")
        .skip(1)
        .filter_map(|el| {
            let el = el.split('>').next()?;
            let num = |n: &str| attr(el, n)?.parse::<u64>().ok();
            Some(((num("data-layer")?, num("data-expert")?, attr(el, "data-kind")?), num("data-committed")?))
        })
        .collect()
}

fn table_cells(v: &Value) -> BTreeMap<(u64, u64, String), u64> {
    v["pages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let key = (
                p["layer"].as_u64().unwrap(),
                p["expert"].as_u64().unwrap(),
                p["kind"].as_str().unwrap().into(),
            );
            (key, p["committed_bits"].as_u64().unwrap())
        })
        .collect()
}

/// The server under test: killed when the test ends, its log printed if the test failed.
struct Server {
    child: std::process::Child,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let status = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("server ({status:?}) log:\n{log}");
        }
    }
}

#[test]
fn the_dashboard_draws_the_page_table_in_a_browser() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-mixtral");
    let profile = tempfile::tempdir().unwrap();
    let log = profile.path().join("server.log");
    let child = Command::new(env!("CARGO_BIN_EXE_pagedweight"))
        .args(["serve", "--fast", "--model", model.to_str().unwrap(), "--gpu-memory-gb", "0.045"])
        .args(["--max-batch", "32", "--port", "0", "--served-name", "tiny"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut server = Server { child, log };
    let mut lines = BufReader::new(server.child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    // Keep reading: a server whose stdout is closed dies on its next line (broken pipe).
    std::thread::spawn(move || lines.for_each(drop));
    let addr = first.split("http://").nth(1).and_then(|r| r.split('/').next()).unwrap().to_string();
    let url = format!("http://{addr}/dashboard");

    // Load: 32 requests at once.
    let load: Vec<_> = (0..32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"model": "tiny", "prompt": "KING HENRY. {i}", "max_tokens": 40, "temperature": 0, "ignore_eos": true}}"#
                );
                http(&addr, "POST", "/v1/completions", Some(&body)).0
            })
        })
        .collect();
    // Under load: one cell per page, each at a stored width.
    let busy = cells(&rendered_dom(&url, profile.path()));
    let v = page_table(&addr);
    let pages = v["pages"].as_array().unwrap().len();
    assert!(pages > 0 && busy.len() == pages, "{} cells for {pages} pages", busy.len());
    assert!(busy.values().all(|b| (3..=8).contains(b)), "{busy:?}");
    for t in load {
        assert_eq!(t.join().unwrap(), 200);
    }
    // Settled (nothing queued or moving, the same boundary twice): the drawing is the table.
    let t0 = Instant::now();
    let settled = loop {
        let a = page_table(&addr);
        std::thread::sleep(Duration::from_millis(300));
        let b = page_table(&addr);
        let moving = b["pages"].as_array().unwrap().iter().any(|p| p["location"] != "gpu");
        if a["boundary"] == b["boundary"] && b["queue_depth"] == 0 && b["active_sequences"] == 0 && !moving {
            break b;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the server did not settle: {b}");
    };
    let dom = rendered_dom(&url, profile.path());
    assert_eq!(cells(&dom), table_cells(&settled));
    assert!(dom.contains("policy <b>planner</b>") && dom.contains("tiny"), "{dom}");
}

/// `pagedweight plot` draws one PNG per run of a `bench-serve` record and names what is
/// missing from a record it cannot draw.
#[test]
fn plot_draws_each_run_of_a_bench_serve_record() {
    let tmp = tempfile::tempdir().unwrap();
    let sample = |t: f64, gb8: f64, gb4: f64, kv: f64| {
        serde_json::json!({"t_s": t, "active": 3, "queue": 1, "mean_bits": 6.0, "kv_gb": kv,
                           "expert_gb_by_bits_3_to_8": [0.0, gb4, 0.0, 0.0, 0.0, gb8]})
    };
    let run = |policy: &str| {
        serde_json::json!({"model": "qwen1.5-moe-a2.7b", "policy": policy, "budget_gb": 20.0,
                           "bit_mix": [sample(0.0, 16.0, 0.0, 0.0), sample(1.0, 10.0, 3.0, 6.0), sample(2.5, 16.0, 0.0, 1.0)]})
    };
    let from = tmp.path().join("serve.json");
    std::fs::write(&from, serde_json::json!([run("pinned-8bit"), run("planner")]).to_string()).unwrap();
    let out = tmp.path().join("png");
    let o = Command::new(env!("CARGO_BIN_EXE_pagedweight"))
        .args(["plot", "--from", from.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for policy in ["pinned-8bit", "planner"] {
        let png = std::fs::read(out.join(format!("qwen1.5-moe-a2.7b-{policy}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{} bytes", png.len());
    }
    let mut bad = run("planner");
    bad["bit_mix"][1]["expert_gb_by_bits_3_to_8"] = serde_json::json!([1.0]);
    std::fs::write(&from, serde_json::json!([bad]).to_string()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_pagedweight"))
        .args(["plot", "--from", from.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("serve.json") && err.contains("bit_mix[1]"), "{err}");
}
