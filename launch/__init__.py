"""fedbus.launch."""
