"""Per-stage scaling experiments against a running deployment (docs/experiments.md).

A client of the public API only (gRPC through h3serve.client, the gateway's Prometheus HTTP endpoint): it never
imports torch, the gateway or the model services, so it measures a deployment from where its users stand.

    loadspec   the load file (TOML): arrivals, bounds, the mix of workflows and canvases; validated
    media      small keyframes and references for fl2va / ref2va, made or taken from the load file, uploaded
    arrivals   when each job is submitted: Poisson at a rate, a trace file, or a closed loop
    workload   the mix's entries as requests, drawn by weight
    driver     submits and watches the jobs (warm-up, bounds, drain), records refusals
    progress   the one-line live progress display
    scrape     the gateway's Prometheus series, scraped periodically
    records    the raw data: jobs, stage records, DiT steps (CSV), read back and written exactly
    runner     one experiment: the above wired together, the raw data written to the output directory
    analysis   utilisation, queue depth, latency percentiles and throughput from the raw data
    plots      the PNGs (matplotlib, Agg)
    report     summary.json and the self-contained report.html, re-rendered from the raw data
    model      the capacity model: a simpy simulation fed with the measured service times
    sweep      several configurations measured one after another, overlaid in one report
"""
