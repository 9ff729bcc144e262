"""fedbus.node."""
