"""cluster: scheduler, engine, and (later) the Ray actors, the Ray Serve app, metrics and the CLI."""
