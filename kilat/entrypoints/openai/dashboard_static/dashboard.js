/* kilat dashboard: reads dashboard/api/stats once a second while the tab is visible and charts what changed
 * between two reads (rates, interval means and percentiles) with uPlot. All arithmetic happens here: the server
 * only hands out its cumulative counters, histogram buckets and gauges. */
(function () {
  "use strict";

  const POLL_MS = 1000;
  const FETCH_TIMEOUT_MS = 5000;
  const WINDOW_S = 300;
  const STATS_URL = "dashboard/api/stats";
  const COLORS = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5"];

  /** Quantile q (0..1) of the observations between two reads of a histogram, as Prometheus's histogram_quantile:
   * le are the finite bucket bounds, cumulative the observations at most each bound, total all of them (the
   * +Inf bucket too). Linear within a bucket; the largest finite bound when the rank lies in +Inf; null when
   * there were no observations. */
  function quantile(le, cumulative, total, q) {
    if (!(total > 0) || le.length === 0) {
      return null;
    }
    const rank = q * total;
    let below = 0;
    let lower = 0;
    for (let i = 0; i < le.length; i++) {
      if (cumulative[i] >= rank) {
        const inBucket = cumulative[i] - below;
        return inBucket > 0 ? lower + (le[i] - lower) * (rank - below) / inBucket : le[i];
      }
      below = cumulative[i];
      lower = le[i];
    }
    return le[le.length - 1];
  }

  /** Mean and p90 (ms) of a histogram's observations between two reads; nulls when there were none. */
  function latency(prev, cur) {
    const count = cur.count - prev.count;
    if (!(count > 0)) {
      return {mean: null, p90: null, count: 0};
    }
    const deltas = cur.cumulative.map((c, i) => c - prev.cumulative[i]);
    return {mean: 1000 * (cur.sum - prev.sum) / count, p90: 1000 * quantile(cur.le, deltas, count, 0.9), count};
  }

  /** A ratio in percent, null when the denominator is not positive. */
  function percent(num, den) {
    return den > 0 ? 100 * num / den : null;
  }

  /** True when cur cannot follow prev (a restarted server: a counter went down, or other buckets). */
  function isReset(prev, cur) {
    if (cur.time <= prev.time) {
      return true;
    }
    if (Object.keys(cur.counters).some((k) => !(cur.counters[k] >= prev.counters[k]))) {
      return true;
    }
    return Object.keys(cur.histograms).some((k) => {
      const a = prev.histograms[k];
      const b = cur.histograms[k];
      return !a || b.count < a.count || a.le.length !== b.le.length || a.le.some((x, i) => x !== b.le[i]);
    });
  }

  /** One chart point at cur.time: the gauges, and what changed since prev (null values without prev). */
  function point(prev, cur) {
    const p = {
      time: cur.time, running: cur.running, waiting: cur.waiting, kvUsage: 100 * cur.kv_cache_usage,
      outputTps: null, promptTps: null, ttftMean: null, ttftP90: null, itlMean: null, itlP90: null,
      prefixHitRate: null, specAcceptance: null,
    };
    if (prev === null || isReset(prev, cur)) {
      return p;
    }
    const dt = cur.time - prev.time;
    const d = (k) => cur.counters[k] - prev.counters[k];
    p.outputTps = d("generation_tokens") / dt;
    p.promptTps = d("prompt_tokens") / dt;
    const ttft = latency(prev.histograms.ttft, cur.histograms.ttft);
    const itl = latency(prev.histograms.itl, cur.histograms.itl);
    p.ttftMean = ttft.mean;
    p.ttftP90 = ttft.p90;
    p.itlMean = itl.mean;
    p.itlP90 = itl.p90;
    p.prefixHitRate = percent(d("prefix_cache_hits"), d("prefix_cache_queries"));
    p.specAcceptance = percent(d("spec_decode_accepted_tokens"), d("spec_decode_draft_tokens"));
    return p;
  }

  /** y scale from 0 to a little above the largest value (1 when nothing is plotted). */
  function fromZero(u, min, max) {
    return [0, max > 0 ? max * 1.1 : 1];
  }

  /* sparse: a null is "nothing observed in that interval" (a line joins the intervals around it), not a gap. */
  const CHARTS = [
    {id: "chart-ttft", series: [["mean", "ttftMean"], ["p90", "ttftP90"]], range: fromZero, digits: 1, sparse: true},
    {id: "chart-itl", series: [["mean", "itlMean"], ["p90", "itlP90"]], range: fromZero, digits: 1, sparse: true},
    {id: "chart-throughput", series: [["output tokens/s", "outputTps"], ["prompt tokens/s", "promptTps"]],
      range: fromZero, digits: 1},
    {id: "chart-requests", series: [["running", "running"], ["waiting", "waiting"]], range: fromZero, digits: 0},
    {id: "chart-kv", series: [["KV cache used %", "kvUsage"]], range: [0, 100], digits: 1},
    {id: "chart-prefix", series: [["hit rate %", "prefixHitRate"]], range: [0, 100], digits: 1, sparse: true},
    {id: "chart-spec", series: [["acceptance %", "specAcceptance"]], range: [0, 100], digits: 1, sparse: true,
      spec: true},
  ];

  const points = [];
  let prevSnapshot = null;
  let lastSnapshot = null;
  let plots = [];
  let timer = null;
  let inFlight = false;

  function fmt(value, digits) {
    return value === null || value === undefined || !Number.isFinite(value) ? "\u2013" : value.toFixed(digits);
  }

  /** The last value of a series that is not null (null when there is none). */
  function newest(values) {
    for (let i = values.length - 1; i >= 0; i--) {
      if (values[i] !== null) {
        return values[i];
      }
    }
    return null;
  }

  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function setStatus(text, kind) {
    const el = document.getElementById("status");
    el.textContent = text;
    el.className = "status " + kind;
  }

  function plotWidth(el) {
    return Math.max(200, el.querySelector(".plot").clientWidth);
  }

  function makePlots(specEnabled) {
    plots = CHARTS.filter((c) => !c.spec || specEnabled).map((c) => {
      const el = document.getElementById(c.id);
      el.hidden = false;
      const opts = {
        width: plotWidth(el),
        height: 180,
        series: [{}].concat(c.series.map(([label], i) => ({
          label, stroke: COLORS[i], width: 2, spanGaps: Boolean(c.sparse),
          // under the cursor: its point; elsewhere: the newest value
          value: (u, v, si, idx) => fmt(idx === null ? newest(u.data[si]) : v, c.digits),
        }))),
        scales: {x: {time: true}, y: {range: c.range}},
        axes: [{}, {size: 56}],
      };
      const chart = {el, spec: c, plot: null};
      chart.plot = new uPlot(opts, [[]].concat(c.series.map(() => [])), el.querySelector(".plot"));
      return chart;
    });
    window.addEventListener("resize", () => {
      plots.forEach((chart) => chart.plot.setSize({width: plotWidth(chart.el), height: 180}));
    });
  }

  function render(snapshot) {
    const latest = points[points.length - 1];
    setText("model", snapshot.model + (snapshot.engines > 1 ? ` (${snapshot.engines} engine cores)` : ""));
    setText("now-output", fmt(latest.outputTps, 1));
    setText("now-running", String(latest.running));
    setText("now-waiting", String(latest.waiting));
    setText("now-kv", fmt(latest.kvUsage, 1) + " %");
    setText("now-ttft", fmt(latest.ttftMean, 1) + " ms");
    setText("now-itl", fmt(latest.itlMean, 1) + " ms");
    const c = snapshot.counters;
    setText("now-prefix", fmt(percent(c.prefix_cache_hits, c.prefix_cache_queries), 1) + " %");
    setText("now-spec", fmt(percent(c.spec_decode_accepted_tokens, c.spec_decode_draft_tokens), 1) + " %");
    setText("now-finished", String(c.requests_finished));
    document.getElementById("now-spec-stat").hidden = !snapshot.spec_decode.enabled;
    const xs = points.map((p) => p.time);
    plots.forEach((chart) => {
      chart.plot.setData([xs].concat(chart.spec.series.map(([, key]) => points.map((p) => p[key]))));
    });
  }

  function update(snapshot) {
    if (plots.length === 0) {
      makePlots(snapshot.spec_decode.enabled);
    }
    points.push(point(prevSnapshot, snapshot));
    while (points.length > 0 && points[0].time < snapshot.time - WINDOW_S) {
      points.shift();
    }
    prevSnapshot = snapshot;
    lastSnapshot = snapshot;
    render(snapshot);
  }

  function visible() {
    return document.visibilityState === "visible";
  }

  function schedule() {
    clearTimeout(timer);
    timer = visible() ? setTimeout(poll, POLL_MS) : null;
  }

  async function poll() {
    clearTimeout(timer); // one polling chain, however poll() was reached
    timer = null;
    if (inFlight || !visible()) {
      return;
    }
    inFlight = true;
    const controller = new AbortController(); // a server that never answers must not stop the polling
    const deadline = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
    try {
      const response = await fetch(STATS_URL, {cache: "no-store", credentials: "same-origin",
                                               signal: controller.signal});
      if (!response.ok) {
        setStatus(`stats: HTTP ${response.status}`, "error");
      } else {
        const snapshot = await response.json();
        if (visible()) { // a read that ends after the tab was hidden is dropped
          update(snapshot);
          setStatus("live", "ok");
        }
      }
    } catch (e) {
      const why = e.name === "AbortError" ? `no answer in ${FETCH_TIMEOUT_MS / 1000} s` : e.message;
      setStatus(`stats unavailable (${why})`, "error");
    } finally {
      clearTimeout(deadline);
      inFlight = false;
      schedule();
    }
  }

  document.addEventListener("visibilitychange", () => {
    if (visible()) {
      poll();
    } else {
      clearTimeout(timer);
      timer = null;
      prevSnapshot = null; // no interval spans the hidden time: the next starts when the tab is shown
      setStatus("paused (tab hidden)", "paused");
    }
  });

  /** For tests and the console: the newest point, all plotted points, how many, the newest snapshot, quantile. */
  window.kilatDashboard = {
    latest: () => (points.length ? Object.assign({}, points[points.length - 1]) : null),
    history: () => points.map((p) => Object.assign({}, p)),
    points: () => points.length,
    snapshot: () => lastSnapshot,
    quantile,
  };

  poll();
})();
