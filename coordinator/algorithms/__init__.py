"""Pure tensor code: state dicts in, state dicts out. No MQTT, files or clocks in here."""
