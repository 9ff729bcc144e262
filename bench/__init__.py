"""fedbus.bench: benchmarks that print figures (run them with `fedbus bench NAME`)."""
