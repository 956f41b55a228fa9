use rslock as _;
use tower_lock as _;
fn main() {}
