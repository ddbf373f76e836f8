"""A failure's life after it is found: the kvfuzz-trace/1 format (``trace``), saving, replaying and exporting traces
(``corpus``), turning the journal of a run the allocator killed into a trace (``journals``), and the line that points
at a saved trace's timeline (``hint``). Everything here sits above the runner and below the commands, the plugin and
``kvfuzz show``."""
