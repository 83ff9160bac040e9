//! `--html`: one self-contained page (XHTML with inline SVG: no script, no
//! stylesheet or font from anywhere) showing the race over time (hit
//! rate, TTFT and requests completed per policy) and the final table. It
//! is well-formed XML, so any XML parser (and the tests) can read it.

use std::fmt::Write;

use super::report::{secs, PolicyResult, Report};

/// One colour per policy, distinguishable in print and for most colour
/// vision deficiencies (Okabe-Ito).
const COLOURS: [&str; 8] = [
    "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#d55e00", "#56b4e9", "#000000", "#f0e442",
];

const W: f64 = 640.0;
const H: f64 = 220.0;
const PAD: f64 = 48.0;

pub fn page(report: &Report, title: &str) -> String {
    let results = &report.results;
    let mut s = String::new();
    let _ = write!(
        s,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE html>\n\
         <html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n\
         <meta charset=\"UTF-8\"/>\n<title>{}</title>\n<style>\n\
         body {{ font-family: sans-serif; margin: 2em; color: #222; }}\n\
         table {{ border-collapse: collapse; }}\n\
         td, th {{ padding: 0.3em 0.8em; border-bottom: 1px solid #ddd; text-align: right; }}\n\
         td:first-child, th:first-child {{ text-align: left; }}\n\
         .chart {{ margin: 1em 0; }}\n\
         </style>\n</head>\n<body>\n<h1>{}</h1>\n",
        esc(title),
        esc(title)
    );
    let _ = writeln!(
        s,
        "<p>Every policy saw the same {} requests in the same order. Curves are by arrival time \
         (virtual seconds): each point is the requests that arrived in that interval.</p>",
        results.first().map_or(0, |r| r.requests)
    );
    s.push_str(&legend(results));
    s.push_str(&chart(results, "Cache hit rate (%)", |p| {
        p.hit_rate * 100.0
    }));
    s.push_str(&chart(results, "Mean time to first token (s)", |p| {
        p.ttft_mean
    }));
    s.push_str(&chart(results, "Requests completed", |p| {
        p.completed as f64
    }));
    s.push_str(&table(results));
    let params = serde_json::to_string_pretty(&report.parameters).unwrap_or_default();
    let _ = write!(
        s,
        "<h2>Parameters</h2>\n<pre>{}</pre>\n</body>\n</html>\n",
        esc(&params)
    );
    s
}

fn legend(results: &[PolicyResult]) -> String {
    let mut s = String::from("<p>");
    for (i, r) in results.iter().enumerate() {
        let _ = write!(
            s,
            "<span style=\"color: {}\">&#9632; {}</span> &#160; ",
            COLOURS[i % COLOURS.len()],
            esc(&r.policy)
        );
    }
    s.push_str("</p>\n");
    s
}

fn chart(
    results: &[PolicyResult],
    title: &str,
    value: impl Fn(&super::report::SeriesPoint) -> f64,
) -> String {
    let t_max = results
        .iter()
        .flat_map(|r| r.series.last())
        .map(|p| p.t)
        .fold(0.0, f64::max)
        .max(1e-9);
    let v_max = results
        .iter()
        .flat_map(|r| r.series.iter().map(&value))
        .fold(0.0, f64::max);
    let v_max = if v_max > 0.0 { v_max * 1.05 } else { 1.0 };
    let x = |t: f64| PAD + t / t_max * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD + -(v / v_max) * (H - 2.0 * PAD);
    let mut s = String::new();
    let (bottom, right, title) = (H - PAD, W - PAD, esc(title));
    let _ = write!(
        s,
        "<div class=\"chart\">\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
         viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{title}\">\n\
         <text x=\"{PAD}\" y=\"20\" font-size=\"14\" font-weight=\"bold\">{title}</text>\n\
         <line x1=\"{PAD}\" y1=\"{bottom:.1}\" x2=\"{right:.1}\" y2=\"{bottom:.1}\" stroke=\"#888\"/>\n\
         <line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{bottom:.1}\" stroke=\"#888\"/>\n",
    );
    for frac in [0.0, 0.5, 1.0] {
        let v = v_max * frac;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\">{}</text>",
            PAD - 4.0,
            y(v) + 3.0,
            short(v)
        );
        let t = t_max * frac;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{}</text>",
            x(t),
            H - PAD + 14.0,
            esc(&secs(t))
        );
    }
    for (i, r) in results.iter().enumerate() {
        let points: Vec<String> = r
            .series
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.t), y(value(p))))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"><title>{}</title></polyline>",
            COLOURS[i % COLOURS.len()],
            points.join(" "),
            esc(&r.policy)
        );
    }
    s.push_str("</svg>\n</div>\n");
    s
}

fn table(results: &[PolicyResult]) -> String {
    let mut s = String::from(
        "<h2>Results</h2>\n<table>\n<tr><th>policy</th><th>completed</th><th>hit rate</th>\
         <th>re-prefilled tokens</th><th>TTFT mean</th><th>p50</th><th>p90</th><th>p99</th>\
         <th>requests/pod max</th><th>mean</th><th>Score calls</th><th>Score µs mean</th></tr>\n",
    );
    for r in results {
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td>{}/{}</td><td>{:.1}%</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td><td>{:.1}</td></tr>",
            esc(&r.policy),
            r.completed,
            r.requests,
            r.hit_rate * 100.0,
            r.reprefilled_tokens,
            esc(&secs(r.ttft_mean)),
            esc(&secs(r.ttft_p50)),
            esc(&secs(r.ttft_p90)),
            esc(&secs(r.ttft_p99)),
            r.requests_per_pod_max,
            r.requests_per_pod_mean,
            r.score_calls,
            r.score_us_mean,
        );
    }
    s.push_str("</table>\n");
    s
}

fn short(v: f64) -> String {
    match v {
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 10.0 => format!("{v:.1}"),
        v => format!("{v:.2}"),
    }
}

/// Text safe inside XML elements and attribute values.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
