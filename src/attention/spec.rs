//! placeholder: the helper writing the reference fills this in.
