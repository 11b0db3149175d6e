"""What users run rather than import: the CLI (demo, bench, doctor, cluster), the local
Ray cluster helpers and the demo's models. The library never imports this folder."""
