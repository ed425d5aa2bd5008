"""The process-wide communicator: init and finalize, backends, rendezvous, output, the runner."""
