"""Run folders (`run.json` + `requests.csv`) and where a run happened (`host`)."""
