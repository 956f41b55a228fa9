//! Enough of an SVG parser to check the demo's picture: its tags and their attributes.

/// A start, end or empty-element tag with its attributes.
pub struct Tag {
    pub name: String,
    attrs: Vec<(String, String)>,
    pub closing: bool,
    pub self_closing: bool,
}

impl Tag {
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether this is a `<name>` whose `class` is `class`.
    pub fn is(&self, name: &str, class: &str) -> bool {
        !self.closing && self.name == name && self.attr("class") == Some(class)
    }

    pub fn num(&self, name: &str) -> f64 {
        let value = self
            .attr(name)
            .unwrap_or_else(|| panic!("{name} on <{}>", self.name));
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is a number"))
    }
}

/// Every tag of `svg`, in order (text, comments and declarations skipped). Enough XML for
/// a file whose attribute values contain no `>`.
pub fn tags(svg: &str) -> Vec<Tag> {
    let mut tags = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        let close = rest[open..].find('>').expect("tag closed") + open;
        let inner = &rest[open + 1..close];
        rest = &rest[close + 1..];
        if inner.starts_with('?') || inner.starts_with('!') {
            continue;
        }
        let closing = inner.starts_with('/');
        let self_closing = inner.ends_with('/');
        let inner = inner.trim_start_matches('/').trim_end_matches('/');
        let (name, mut attrs_text) = inner.split_once(char::is_whitespace).unwrap_or((inner, ""));
        let mut attrs = Vec::new();
        while let Some((key, value_and_rest)) = attrs_text.split_once("=\"") {
            let (value, after) = value_and_rest.split_once('"').expect("attribute quoted");
            attrs.push((key.trim().to_owned(), value.to_owned()));
            attrs_text = after;
        }
        tags.push(Tag {
            name: name.to_owned(),
            attrs,
            closing,
            self_closing,
        });
    }
    tags
}

/// The tags inside the first `<g>` that `is` picks, without the `<g>` itself.
pub fn group(tags: &[Tag], is: impl Fn(&Tag) -> bool) -> &[Tag] {
    let open = tags
        .iter()
        .position(|t| t.name == "g" && !t.closing && !t.self_closing && is(t))
        .expect("the group is in the picture");
    let mut depth = 0;
    for (i, tag) in tags.iter().enumerate().skip(open) {
        match tag.name.as_str() {
            "g" if tag.closing => depth -= 1,
            "g" if !tag.self_closing => depth += 1,
            _ => {}
        }
        if depth == 0 {
            return &tags[open + 1..i];
        }
    }
    panic!("the group is closed")
}

/// A drawn rectangle, in pixels.
#[derive(Clone, Copy, Debug)]
pub struct Rect {
    pub x: f64,
    pub y: f64,
    pub width: f64,
    pub height: f64,
}

impl Rect {
    pub fn of(tag: &Tag) -> Self {
        Rect {
            x: tag.num("x"),
            y: tag.num("y"),
            width: tag.num("width"),
            height: tag.num("height"),
        }
    }

    /// Whether the two share more than `slack` pixels either way (the file rounds to
    /// hundredths: marks that touch may seem to overlap by that much).
    pub fn overlaps(&self, other: &Rect, slack: f64) -> bool {
        let across =
            self.x + self.width - slack > other.x && other.x + other.width - slack > self.x;
        let down =
            self.y + self.height - slack > other.y && other.y + other.height - slack > self.y;
        across && down
    }
}
