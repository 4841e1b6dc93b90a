"""`hybridkv report`: report.md, report.html and figures for a run folder, the verdict first; `--compare`."""
