//! What clients sent a server, as `MONITOR` shows it.

use std::time::Duration;

use futures_util::StreamExt;

/// What the clients of the server at `url` sent that names `key` while `during` ran, in
/// the order the server ran it (`MONITOR`), each as its words: what scripts ran inside left
/// out. On a cluster, `url` is the node that owns `key`'s slot.
pub async fn commands_sent<F: Future>(
    url: &str,
    key: &str,
    during: F,
) -> (F::Output, Vec<Vec<String>>) {
    let client = redis::Client::open(url).expect("url");
    let mut monitor = client
        .get_async_monitor()
        .await
        .expect("MONITOR")
        .into_on_message::<String>();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let mut echo = async |marker: &str| {
        let _: String = redis::cmd("ECHO")
            .arg(marker)
            .query_async(&mut conn)
            .await
            .expect("ECHO");
    };
    echo("commands-sent-begin").await;
    let output = during.await;
    echo("commands-sent-end").await;
    let mut sent = Vec::new();
    let mut begun = false;
    loop {
        let line = tokio::time::timeout(Duration::from_secs(10), monitor.next())
            .await
            .expect("MONITOR lines")
            .expect("MONITOR open");
        if line.contains("\"commands-sent-begin\"") {
            begun = true;
        } else if line.contains("\"commands-sent-end\"") {
            return (output, sent);
        } else if begun && !line.contains(" lua] ") && line.contains(key) {
            sent.push(words(&line));
        }
    }
}

/// The quoted words of a `MONITOR` line (`123.45 [0 127.0.0.1:5000] "get" "k"`).
fn words(line: &str) -> Vec<String> {
    let Some((_, command)) = line.split_once("] ") else {
        return Vec::new();
    };
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = command.chars();
    while let Some(c) = chars.next() {
        match (c, &mut word) {
            ('"', None) => word = Some(String::new()),
            ('"', Some(_)) => words.extend(word.take()),
            ('\\', Some(w)) => w.extend(chars.next()),
            (c, Some(w)) => w.push(c),
            (_, None) => {}
        }
    }
    words
}
