"""fedbus.broker."""
