"""The public methods of a communicator, one mixin per family."""
