"""Push mode: direct workers that listen for syncs instead of taking a Ray call each."""
