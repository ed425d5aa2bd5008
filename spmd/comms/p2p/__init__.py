"""Point-to-point messages: the public methods, receives in flight, messages to self."""
