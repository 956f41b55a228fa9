-- tower-lock's MySQL/MariaDB schema, version 2: four InnoDB tables and the stored
-- procedures that the MySqlBackend calls, one CALL per primitive (no transaction stays
-- open while a lock is held). Version 2 added the idempotency records
-- (tower_lock_records, tower_lock_record_store); running this file upgrades version 1.
--
-- Run it once per database with the client (mariadb app < schema.sql; it sets its own
-- DELIMITER), or let MySqlBackend::builder(..).migrate() do it at build. Procedures are
-- dropped and created again, so run it while no instance uses them (migrate() does it only
-- when the version differs). The backend with another table name runs this text with
-- `tower_lock` replaced by that name (MySqlBackend::schema_sql(table) prints it).
--
-- Every procedure that changes a lock runs one short transaction that takes the name's
-- row FOR UPDATE first (INSERT ... ON DUPLICATE KEY UPDATE takes it exclusively even when
-- the row is new), so the operations on one name run one after another. Times are the
-- server's clock (UTC_TIMESTAMP(6), fixed for the whole CALL), never the application's.
-- Replies are one row of one column: integers joined by commas, the first saying what
-- happened (see each procedure).
--
-- Waiters: each backend parks one connection (its wake connection) in
-- SELECT ... GET_LOCK(gate, n), a named lock its second connection holds, and registers (channel, CONNECTION_ID()) in tower_lock_waiters for
-- the keys it waits for. A release that frees a name with waiters marks their rows woken
-- once it has committed and cuts their connections' wait short with KILL QUERY (see
-- tower_lock_wake): the waiting costs no statements, and the uncontended path no more
-- than the look-up of the name's waiters inside the CALL.

-- One row per lock (or semaphore) name while it is held, waited for, or its fencing
-- counter is kept: deleted by tower_lock_sweep once free for the fence retention.
CREATE TABLE IF NOT EXISTS tower_lock (
    name         VARBINARY(2800) NOT NULL PRIMARY KEY,
    -- The exclusive holder and its re-entry count; NULL: none.
    owner        VARBINARY(255) NULL,
    count        INT NOT NULL DEFAULT 0,
    -- The end of the exclusive holder's lease (UTC).
    expires      DATETIME(6) NULL,
    -- The fencing token of the last exclusive hold (shared holds carry it).
    token        BIGINT NOT NULL DEFAULT 0,
    -- The highest token issued or reserved for the name: the next one is above it.
    fence        BIGINT NOT NULL DEFAULT 0,
    -- Release ids of the holder's re-entries given back, each followed by a newline.
    undone       BLOB NULL,
    -- Shared holders and registered waiting writers in tower_lock_holders.
    readers      INT NOT NULL DEFAULT 0,
    writers      INT NOT NULL DEFAULT 0,
    -- The last other instance that waits for the name, and until when: a run of one
    -- instance's holders ends by freeing the lock for it.
    waiter       VARBINARY(255) NULL,
    waiter_until DATETIME(6) NULL,
    -- The last acquisition or final release.
    touched      DATETIME(6) NOT NULL,
    KEY tower_lock_touched (touched)
) ENGINE = InnoDB;

-- Holders with a lease of their own: shared holds ('s', holder 'r:' + owner), semaphore
-- permits ('p'), and writers waiting for shared holders to leave ('w', until the end of
-- their wait; new shared holds queue behind them).
CREATE TABLE IF NOT EXISTS tower_lock_holders (
    name    VARBINARY(2800) NOT NULL,
    holder  VARBINARY(255) NOT NULL,
    kind    BINARY(1) NOT NULL,
    count   INT NOT NULL DEFAULT 1,
    token   BIGINT NOT NULL DEFAULT 0,
    expires DATETIME(6) NOT NULL,
    undone  BLOB NULL,
    PRIMARY KEY (name, holder)
) ENGINE = InnoDB;

-- The wake connections waiting for releases on a channel (a hash of the lock name), and
-- whether a release woke them since they last looked.
CREATE TABLE IF NOT EXISTS tower_lock_waiters (
    channel VARBINARY(32) NOT NULL,
    conn    BIGINT UNSIGNED NOT NULL,
    woken   TINYINT NOT NULL DEFAULT 0,
    PRIMARY KEY (channel, conn),
    KEY tower_lock_waiters_conn (conn, woken)
) ENGINE = InnoDB;

-- IdempotencyLayer's records: the response stored for a lock name by the hold that ran
-- the handler (tower_lock_record_store), replayed until `expires` (UTC); deleted by
-- tower_lock_sweep once expired.
CREATE TABLE IF NOT EXISTS tower_lock_records (
    name    VARBINARY(2800) NOT NULL PRIMARY KEY,
    record  LONGBLOB NOT NULL,
    expires DATETIME(6) NOT NULL,
    KEY tower_lock_records_exp (expires)
) ENGINE = InnoDB;

DELIMITER //

-- Marks the waiters of p_channel woken and cuts their wake connections' park short.
-- Called after the release's COMMIT: a wake connection that looks after this finds its
-- row woken, one that is parked already is interrupted. Only rows not woken yet are
-- interrupted: a row still marked has a KILL on its way or being read, and a KILL waits
-- for its target, so that concurrent ones would queue up behind each other. A connection
-- that is gone, or that this user may not KILL (another user without CONNECTION ADMIN),
-- is skipped.
DROP PROCEDURE IF EXISTS tower_lock_wake //
CREATE PROCEDURE tower_lock_wake(p_channel VARBINARY(32)) SQL SECURITY INVOKER
BEGIN
    DECLARE conns TEXT;
    DECLARE c VARCHAR(21);
    -- Unknown thread id, not the owner of the thread.
    DECLARE CONTINUE HANDLER FOR 1094, 1095 BEGIN END;
    START TRANSACTION;
    SELECT GROUP_CONCAT(conn) INTO conns FROM tower_lock_waiters
    WHERE channel = p_channel AND woken = 0 FOR UPDATE;
    UPDATE tower_lock_waiters SET woken = 1 WHERE channel = p_channel AND woken = 0;
    COMMIT;
    WHILE conns IS NOT NULL AND conns <> '' DO
        SET c = SUBSTRING_INDEX(conns, ',', 1);
        SET conns = IF(LOCATE(',', conns) > 0, SUBSTRING(conns, LOCATE(',', conns) + 1), '');
        KILL QUERY CAST(c AS UNSIGNED);
    END WHILE;
END //

-- The row of `p_name`, created if missing, locked until the transaction ends.
DROP PROCEDURE IF EXISTS tower_lock_row //
CREATE PROCEDURE tower_lock_row(p_name VARBINARY(2800), p_now DATETIME(6))
SQL SECURITY INVOKER
INSERT INTO tower_lock (name, touched) VALUES (p_name, p_now)
ON DUPLICATE KEY UPDATE name = name //

-- Drops the holders of `p_kind` of `p_name` whose lease ended; returns how many are left
-- and when the first of their leases ends. The caller holds the name's row.
DROP PROCEDURE IF EXISTS tower_lock_prune //
CREATE PROCEDURE tower_lock_prune(p_name VARBINARY(2800), p_kind BINARY(1),
    p_now DATETIME(6), OUT live INT, OUT earliest DATETIME(6))
SQL SECURITY INVOKER
BEGIN
    DELETE FROM tower_lock_holders WHERE name = p_name AND kind = p_kind AND expires <= p_now;
    SELECT COUNT(*), MIN(expires) INTO live, earliest
    FROM tower_lock_holders WHERE name = p_name AND kind = p_kind;
END //

-- Takes or re-enters the exclusive lock of `p_name` for `p_holder`.
-- p_wait_ms: how long the caller still waits (0: not at all); p_reserve: tokens to reserve
-- above a new hold's own; p_yielding: leave a free lock to another instance that waits;
-- p_instance: the caller's instance id.
-- Replies 1,token,count (count > 1: a re-entry), 0,ms when held by another (ms: its lease
-- left), 0,ms,1 when kept out by shared holders and registered as a waiting writer (ms:
-- until the first shared lease ends), 4 when the holder holds it shared (no upgrade), 5
-- when left to another instance.
DROP PROCEDURE IF EXISTS tower_lock_acquire //
CREATE PROCEDURE tower_lock_acquire(p_name VARBINARY(2800), p_holder VARBINARY(255),
    p_lease_ms BIGINT, p_wait_ms BIGINT, p_reserve BIGINT, p_yielding BOOLEAN,
    p_instance VARBINARY(255))
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE reply VARCHAR(64);
    DECLARE l_owner, l_waiter VARBINARY(255);
    DECLARE l_count, l_readers, l_writers, live INT;
    DECLARE l_expires, l_waiter_until, earliest DATETIME(6);
    DECLARE l_token, l_fence, new_token BIGINT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    CALL tower_lock_row(p_name, t_now);
    SELECT owner, count, expires, token, fence, readers, writers, waiter, waiter_until
    INTO l_owner, l_count, l_expires, l_token, l_fence, l_readers, l_writers, l_waiter,
        l_waiter_until
    FROM tower_lock WHERE name = p_name FOR UPDATE;
    body: BEGIN
        IF l_owner = p_holder AND l_expires > t_now THEN
            UPDATE tower_lock
            SET count = count + 1,
                expires = GREATEST(expires, t_now + INTERVAL p_lease_ms * 1000 MICROSECOND)
            WHERE name = p_name;
            SET reply = CONCAT_WS(',', 1, l_token, l_count + 1);
            LEAVE body;
        END IF;
        IF l_owner IS NOT NULL AND l_expires > t_now THEN
            IF p_wait_ms > 0 AND (NOT (l_waiter <=> p_instance)
                    OR l_waiter_until < t_now + INTERVAL p_wait_ms * 500 MICROSECOND) THEN
                UPDATE tower_lock
                SET waiter = p_instance,
                    waiter_until = t_now + INTERVAL p_wait_ms * 1000 MICROSECOND
                WHERE name = p_name;
            END IF;
            SET reply = CONCAT_WS(',', 0, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, t_now, l_expires) / 1000)));
            LEAVE body;
        END IF;
        IF l_readers > 0 THEN
            IF EXISTS (SELECT 1 FROM tower_lock_holders WHERE name = p_name
                    AND holder = CONCAT('r:', p_holder) AND expires > t_now) THEN
                SET reply = '4';
                LEAVE body;
            END IF;
            CALL tower_lock_prune(p_name, 's', t_now, live, earliest);
            UPDATE tower_lock SET readers = live WHERE name = p_name;
            IF live > 0 THEN
                IF p_wait_ms = 0 THEN
                    SET reply = CONCAT_WS(',', 0, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, t_now, (SELECT MAX(expires)
                        FROM tower_lock_holders WHERE name = p_name AND kind = 's')) / 1000)));
                    LEAVE body;
                END IF;
                INSERT INTO tower_lock_holders (name, holder, kind, count, expires)
                VALUES (p_name, p_holder, 'w', 0,
                    t_now + INTERVAL p_wait_ms * 1000 MICROSECOND)
                ON DUPLICATE KEY UPDATE expires = VALUES(expires);
                UPDATE tower_lock SET writers = (SELECT COUNT(*) FROM tower_lock_holders
                    WHERE name = p_name AND kind = 'w') WHERE name = p_name;
                SET reply = CONCAT_WS(',', 0, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, t_now, earliest) / 1000)), 1);
                LEAVE body;
            END IF;
        END IF;
        IF p_yielding AND l_waiter IS NOT NULL AND l_waiter <> p_instance
                AND l_waiter_until > t_now THEN
            SET reply = '5';
            LEAVE body;
        END IF;
        SET new_token = GREATEST(l_fence + 1, TIMESTAMPDIFF(MICROSECOND, '1970-01-01', t_now));
        IF l_writers > 0 THEN
            DELETE FROM tower_lock_holders
            WHERE name = p_name AND holder = p_holder AND kind = 'w';
            UPDATE tower_lock SET writers = (SELECT COUNT(*) FROM tower_lock_holders
                WHERE name = p_name AND kind = 'w') WHERE name = p_name;
        END IF;
        UPDATE tower_lock
        SET owner = p_holder, count = 1,
            expires = t_now + INTERVAL p_lease_ms * 1000 MICROSECOND, token = new_token,
            fence = new_token + p_reserve, undone = NULL, touched = t_now,
            waiter = IF(waiter = p_instance, NULL, waiter)
        WHERE name = p_name;
        SET reply = CONCAT_WS(',', 1, new_token, 1);
    END;
    COMMIT;
    SELECT reply;
END //

-- Gives back one exclusive hold of `p_name` by `p_holder`, idempotently per p_release_id,
-- or hands the lock to p_successor (a task of the same process).
-- p_only_token: act only on the hold of this token (NULL: any); p_retried: an earlier call
-- of this release may have run; p_run_spent: the holder's process had its turn, so free
-- the lock if another instance waits; p_issued: the last token the process issued in
-- memory under this hold (NULL: none); p_reserve: tokens to reserve for the successor.
-- Replies 3,token when handed to the successor under a new token, 2 when freed (and the
-- waiters of p_channel woken), 1 when an outer hold remains (or this one was already
-- given back), 0 when the holder does not hold the lock.
DROP PROCEDURE IF EXISTS tower_lock_release //
CREATE PROCEDURE tower_lock_release(p_name VARBINARY(2800), p_holder VARBINARY(255),
    p_release_id VARBINARY(300), p_lease_ms BIGINT, p_channel VARBINARY(32),
    p_only_token BIGINT, p_retried BOOLEAN, p_successor VARBINARY(255),
    p_successor_lease_ms BIGINT, p_run_spent BOOLEAN, p_issued BIGINT, p_reserve BIGINT,
    p_instance VARBINARY(255))
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE reply VARCHAR(64) DEFAULT '0';
    DECLARE l_owner, l_waiter VARBINARY(255);
    DECLARE l_count, l_readers INT;
    DECLARE l_expires, l_waiter_until DATETIME(6);
    DECLARE l_token, last_token BIGINT;
    DECLARE l_undone BLOB;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    SELECT owner, count, expires, token, undone, readers, waiter, waiter_until
    INTO l_owner, l_count, l_expires, l_token, l_undone, l_readers, l_waiter, l_waiter_until
    FROM tower_lock WHERE name = p_name FOR UPDATE;
    body: BEGIN
        IF l_owner IS NULL AND l_token IS NULL THEN
            LEAVE body;
        END IF;
        IF LOCATE(CONCAT(CHAR(10), p_release_id, CHAR(10)), CONCAT(CHAR(10), IFNULL(l_undone, ''))) > 0 THEN
            SET reply = '1';
            LEAVE body;
        END IF;
        IF p_retried AND p_successor IS NOT NULL AND l_owner = p_successor
                AND l_expires > t_now THEN
            SET reply = CONCAT_WS(',', 3, l_token);
            LEAVE body;
        END IF;
        IF NOT (l_owner <=> p_holder) OR l_expires <= t_now
                OR (p_only_token IS NOT NULL AND l_token <> p_only_token) THEN
            LEAVE body;
        END IF;
        IF l_count > 1 THEN
            UPDATE tower_lock
            SET count = count - 1, undone = CONCAT(IFNULL(undone, ''), p_release_id, CHAR(10)),
                expires = GREATEST(expires, t_now + INTERVAL p_lease_ms * 1000 MICROSECOND)
            WHERE name = p_name;
            SET reply = '1';
            LEAVE body;
        END IF;
        SET last_token = IFNULL(p_issued, l_token);
        IF p_successor IS NOT NULL AND NOT (p_run_spent AND l_waiter IS NOT NULL
                AND l_waiter <> p_instance AND l_waiter_until > t_now)
                AND NOT (l_readers > 0 AND EXISTS (SELECT 1 FROM tower_lock_holders
                    WHERE name = p_name AND holder = CONCAT('r:', p_holder)
                    AND expires > t_now)) THEN
            UPDATE tower_lock
            SET owner = p_successor, count = 1, token = last_token + 1,
                fence = last_token + 1 + p_reserve, undone = NULL, touched = t_now,
                expires = t_now + INTERVAL p_successor_lease_ms * 1000 MICROSECOND
            WHERE name = p_name;
            SET reply = CONCAT_WS(',', 3, last_token + 1);
            LEAVE body;
        END IF;
        -- Freed, or left to the holder's own shared hold (a downgrade).
        UPDATE tower_lock
        SET owner = NULL, count = 0, expires = NULL, undone = NULL, token = last_token,
            fence = GREATEST(fence, last_token), touched = t_now
        WHERE name = p_name;
        SET reply = '2';
    END;
    COMMIT;
    IF reply = '2' THEN
        CALL tower_lock_wake(p_channel);
    END IF;
    SELECT reply;
END //

-- Extends (never shortens) the leases of a batch of holds, and says for each whether its
-- holder still holds it: an exclusive hold (tower_lock.owner) or a holder with its own
-- lease. p_batch is a JSON array of [name, holder, lease_ms]; a lease of 0 only checks.
-- Replies one row per hold, in the batch's order: 1 held, 0 not.
DROP PROCEDURE IF EXISTS tower_lock_renew //
CREATE PROCEDURE tower_lock_renew(p_batch LONGTEXT) SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    UPDATE tower_lock l JOIN JSON_TABLE(p_batch, '$[*]' COLUMNS (
            name VARCHAR(2800) PATH '$[0]', holder VARCHAR(255) PATH '$[1]',
            lease BIGINT PATH '$[2]')) b
        ON l.name = b.name AND l.owner = b.holder
    SET l.expires = GREATEST(l.expires, t_now + INTERVAL b.lease * 1000 MICROSECOND)
    WHERE l.expires > t_now AND b.lease > 0;
    UPDATE tower_lock_holders h JOIN JSON_TABLE(p_batch, '$[*]' COLUMNS (
            name VARCHAR(2800) PATH '$[0]', holder VARCHAR(255) PATH '$[1]',
            lease BIGINT PATH '$[2]')) b
        ON h.name = b.name AND h.holder = b.holder
    SET h.expires = GREATEST(h.expires, t_now + INTERVAL b.lease * 1000 MICROSECOND)
    WHERE h.kind IN ('s', 'p') AND h.expires > t_now AND b.lease > 0;
    SELECT EXISTS (SELECT 1 FROM tower_lock l WHERE l.name = b.name AND l.owner = b.holder
            AND l.expires > t_now)
        OR EXISTS (SELECT 1 FROM tower_lock_holders h WHERE h.name = b.name
            AND h.holder = b.holder AND h.kind IN ('s', 'p') AND h.expires > t_now)
    FROM JSON_TABLE(p_batch, '$[*]' COLUMNS (i FOR ORDINALITY,
            name VARCHAR(2800) PATH '$[0]', holder VARCHAR(255) PATH '$[1]')) b
    ORDER BY b.i;
END //

-- Takes or re-enters a shared hold of `p_name`'s read/write lock for p_holder ('r:' +
-- p_owner). Replies 1,token,count (token: the last exclusive hold's), or 0,ms when a
-- writer holds it or waits for it (ms: its lease or wait left).
DROP PROCEDURE IF EXISTS tower_lock_shared_acquire //
CREATE PROCEDURE tower_lock_shared_acquire(p_name VARBINARY(2800), p_holder VARBINARY(255),
    p_owner VARBINARY(255), p_lease_ms BIGINT)
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE reply VARCHAR(64);
    DECLARE l_owner VARBINARY(255);
    DECLARE l_writers, h_count, live INT;
    DECLARE l_expires, h_expires, earliest DATETIME(6);
    DECLARE l_token BIGINT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    CALL tower_lock_row(p_name, t_now);
    SELECT owner, expires, token, writers INTO l_owner, l_expires, l_token, l_writers
    FROM tower_lock WHERE name = p_name FOR UPDATE;
    SELECT count, expires INTO h_count, h_expires FROM tower_lock_holders
    WHERE name = p_name AND holder = p_holder FOR UPDATE;
    body: BEGIN
        IF h_expires > t_now THEN
            UPDATE tower_lock_holders
            SET count = count + 1,
                expires = GREATEST(expires, t_now + INTERVAL p_lease_ms * 1000 MICROSECOND)
            WHERE name = p_name AND holder = p_holder;
            SET reply = CONCAT_WS(',', 1, l_token, h_count + 1);
            LEAVE body;
        END IF;
        IF h_expires IS NOT NULL THEN
            DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
        END IF;
        IF l_owner IS NOT NULL AND l_expires > t_now THEN
            IF l_owner <> p_owner THEN
                SET reply = CONCAT_WS(',', 0, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, t_now, l_expires) / 1000)));
                LEAVE body;
            END IF;
            -- The writer itself: a downgrade, let in whoever waits.
        ELSEIF l_writers > 0 THEN
            CALL tower_lock_prune(p_name, 'w', t_now, live, earliest);
            UPDATE tower_lock SET writers = live WHERE name = p_name;
            IF live > 0 THEN
                SET reply = CONCAT_WS(',', 0, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, t_now, earliest) / 1000)));
                LEAVE body;
            END IF;
        END IF;
        INSERT INTO tower_lock_holders (name, holder, kind, count, token, expires)
        VALUES (p_name, p_holder, 's', 1, l_token,
            t_now + INTERVAL p_lease_ms * 1000 MICROSECOND);
        UPDATE tower_lock SET touched = t_now, readers = (SELECT COUNT(*)
            FROM tower_lock_holders WHERE name = p_name AND kind = 's') WHERE name = p_name;
        SET reply = CONCAT_WS(',', 1, l_token, 1);
    END;
    COMMIT;
    SELECT reply;
END //

-- Takes or re-enters one of p_permits permits of the semaphore `p_name` for p_holder.
-- Replies 1,token,count, or 0,ms when all are taken (ms: until the first holder's lease
-- ends).
DROP PROCEDURE IF EXISTS tower_lock_permit_acquire //
CREATE PROCEDURE tower_lock_permit_acquire(p_name VARBINARY(2800), p_holder VARBINARY(255),
    p_lease_ms BIGINT, p_permits INT)
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE reply VARCHAR(64);
    DECLARE h_count, live INT;
    DECLARE h_expires, earliest DATETIME(6);
    DECLARE l_fence, h_token, new_token BIGINT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    CALL tower_lock_row(p_name, t_now);
    SELECT fence INTO l_fence FROM tower_lock WHERE name = p_name FOR UPDATE;
    SELECT count, expires, token INTO h_count, h_expires, h_token FROM tower_lock_holders
    WHERE name = p_name AND holder = p_holder FOR UPDATE;
    body: BEGIN
        IF h_expires > t_now THEN
            UPDATE tower_lock_holders
            SET count = count + 1,
                expires = GREATEST(expires, t_now + INTERVAL p_lease_ms * 1000 MICROSECOND)
            WHERE name = p_name AND holder = p_holder;
            SET reply = CONCAT_WS(',', 1, h_token, h_count + 1);
            LEAVE body;
        END IF;
        CALL tower_lock_prune(p_name, 'p', t_now, live, earliest);
        IF live >= p_permits THEN
            SET reply = CONCAT_WS(',', 0, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, t_now, earliest) / 1000)));
            LEAVE body;
        END IF;
        SET new_token = GREATEST(l_fence + 1, TIMESTAMPDIFF(MICROSECOND, '1970-01-01', t_now));
        UPDATE tower_lock SET fence = new_token, touched = t_now WHERE name = p_name;
        INSERT INTO tower_lock_holders (name, holder, kind, count, token, expires)
        VALUES (p_name, p_holder, 'p', 1, new_token,
            t_now + INTERVAL p_lease_ms * 1000 MICROSECOND)
        ON DUPLICATE KEY UPDATE kind = 'p', count = 1, token = new_token, undone = NULL,
            expires = VALUES(expires);
        SET reply = CONCAT_WS(',', 1, new_token, 1);
    END;
    COMMIT;
    SELECT reply;
END //

-- Gives back one hold of a holder with its own lease (a shared hold, a permit),
-- idempotently per p_release_id. Replies 2 when the holder's hold ended (the waiters woken
-- when that frees a permit or the last shared hold), 1 when an outer hold remains (or this
-- one was already given back), 0 when the holder holds nothing (or under another token
-- than p_only_token).
DROP PROCEDURE IF EXISTS tower_lock_holder_release //
CREATE PROCEDURE tower_lock_holder_release(p_name VARBINARY(2800),
    p_holder VARBINARY(255), p_release_id VARBINARY(300), p_lease_ms BIGINT,
    p_channel VARBINARY(32), p_only_token BIGINT)
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE reply VARCHAR(64) DEFAULT '0';
    DECLARE wake BOOLEAN DEFAULT FALSE;
    DECLARE l_owner VARBINARY(255);
    DECLARE h_kind BINARY(1);
    DECLARE h_count, live INT;
    DECLARE l_expires, h_expires, earliest DATETIME(6);
    DECLARE h_token BIGINT;
    DECLARE h_undone BLOB;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    SELECT owner, expires INTO l_owner, l_expires FROM tower_lock
    WHERE name = p_name FOR UPDATE;
    SELECT kind, count, expires, token, undone
    INTO h_kind, h_count, h_expires, h_token, h_undone
    FROM tower_lock_holders WHERE name = p_name AND holder = p_holder FOR UPDATE;
    body: BEGIN
        IF h_kind IS NULL THEN
            LEAVE body;
        END IF;
        IF LOCATE(CONCAT(CHAR(10), p_release_id, CHAR(10)), CONCAT(CHAR(10), IFNULL(h_undone, ''))) > 0 THEN
            SET reply = '1';
            LEAVE body;
        END IF;
        IF h_kind NOT IN ('s', 'p') OR h_expires <= t_now
                OR (p_only_token IS NOT NULL AND h_token <> p_only_token) THEN
            LEAVE body;
        END IF;
        IF h_count > 1 THEN
            UPDATE tower_lock_holders
            SET count = count - 1, undone = CONCAT(IFNULL(undone, ''), p_release_id, CHAR(10)),
                expires = GREATEST(expires, t_now + INTERVAL p_lease_ms * 1000 MICROSECOND)
            WHERE name = p_name AND holder = p_holder;
            SET reply = '1';
            LEAVE body;
        END IF;
        DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder;
        SET reply = '2';
        IF h_kind = 'p' THEN
            UPDATE tower_lock SET touched = t_now WHERE name = p_name;
            SET wake = TRUE;
            LEAVE body;
        END IF;
        CALL tower_lock_prune(p_name, 's', t_now, live, earliest);
        UPDATE tower_lock SET readers = live, touched = t_now WHERE name = p_name;
        -- A downgraded writer's shared hold: its exclusive hold still keeps everyone out.
        SET wake = live = 0 AND (l_owner IS NULL OR l_expires <= t_now);
    END;
    COMMIT;
    IF wake THEN
        CALL tower_lock_wake(p_channel);
    END IF;
    SELECT reply;
END //

-- A snapshot of the lock (or, if p_semaphore, the semaphore) `p_name`, for operators:
-- mode,holders,holds,lease,token; mode 0 free, 1 exclusive, 2 shared, 3 permits; lease:
-- milliseconds the longest lease still runs, -1 when free; token: the highest fencing
-- token issued or reserved for the name (0: none). Never owner ids.
DROP PROCEDURE IF EXISTS tower_lock_snapshot //
CREATE PROCEDURE tower_lock_snapshot(p_name VARBINARY(2800), p_semaphore BOOLEAN,
    p_now DATETIME(6), OUT reply VARCHAR(128))
SQL SECURITY INVOKER
BEGIN
    DECLARE l_owner VARBINARY(255);
    DECLARE l_count, n INT;
    DECLARE l_expires, latest DATETIME(6);
    DECLARE token, total BIGINT;
    SELECT owner, count, expires, fence INTO l_owner, l_count, l_expires, token
    FROM tower_lock WHERE name = p_name;
    SET token = IFNULL(token, 0);
    SELECT COUNT(*), IFNULL(SUM(count), 0), MAX(expires) INTO n, total, latest
    FROM tower_lock_holders
    WHERE name = p_name AND expires > p_now AND kind = IF(p_semaphore, 'p', 's');
    IF p_semaphore AND n > 0 THEN
        SET reply = CONCAT_WS(',', 3, n, total, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, p_now, latest) / 1000)), token);
    ELSEIF NOT p_semaphore AND l_owner IS NOT NULL AND l_expires > p_now THEN
        SET reply = CONCAT_WS(',', 1, 1, l_count,
            GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, p_now, GREATEST(l_expires, IFNULL(latest, l_expires))) / 1000)), token);
    ELSEIF NOT p_semaphore AND n > 0 THEN
        SET reply = CONCAT_WS(',', 2, n, total, GREATEST(0, CEIL(TIMESTAMPDIFF(MICROSECOND, p_now, latest) / 1000)), token);
    ELSE
        SET reply = CONCAT_WS(',', 0, 0, 0, -1, token);
    END IF;
END //

DROP PROCEDURE IF EXISTS tower_lock_inspect //
CREATE PROCEDURE tower_lock_inspect(p_name VARBINARY(2800), p_semaphore BOOLEAN)
SQL SECURITY INVOKER
BEGIN
    DECLARE reply VARCHAR(128);
    CALL tower_lock_snapshot(p_name, p_semaphore, UTC_TIMESTAMP(6), reply);
    SELECT reply;
END //

-- Frees the lock (or, if p_semaphore, every permit of the semaphore) `p_name` whatever
-- holds it, an operator's action, and replies its snapshot from before. Fenced: the next
-- token is above the name's counter, which is at least every token issued or reserved.
-- The waiters of p_channel are woken, and every backend of the namespace through p_admin,
-- so that the holder re-checks its holds and finds this one lost. Waiting writers stay
-- registered: they still wait.
DROP PROCEDURE IF EXISTS tower_lock_force_release //
CREATE PROCEDURE tower_lock_force_release(p_name VARBINARY(2800), p_semaphore BOOLEAN,
    p_channel VARBINARY(32), p_admin VARBINARY(32))
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE freed VARCHAR(128);
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    SELECT 1 INTO @tower_lock_found FROM tower_lock WHERE name = p_name FOR UPDATE;
    CALL tower_lock_snapshot(p_name, p_semaphore, t_now, freed);
    IF freed NOT LIKE '0,%' THEN
        IF p_semaphore THEN
            DELETE FROM tower_lock_holders WHERE name = p_name AND kind = 'p';
            UPDATE tower_lock SET touched = t_now WHERE name = p_name;
        ELSE
            DELETE FROM tower_lock_holders WHERE name = p_name AND kind = 's';
            UPDATE tower_lock
            SET owner = NULL, count = 0, expires = NULL, undone = NULL, readers = 0,
                touched = t_now
            WHERE name = p_name;
        END IF;
    END IF;
    COMMIT;
    IF freed NOT LIKE '0,%' THEN
        CALL tower_lock_wake(p_channel);
        CALL tower_lock_wake(p_admin);
    END IF;
    SELECT freed;
END //

-- Withdraws p_holder's registration as a waiting writer of `p_name` (it stopped waiting),
-- and wakes the name's waiters if p_wake (shared holds it kept out may come in).
DROP PROCEDURE IF EXISTS tower_lock_withdraw //
CREATE PROCEDURE tower_lock_withdraw(p_name VARBINARY(2800), p_holder VARBINARY(255),
    p_channel VARBINARY(32), p_wake BOOLEAN)
SQL SECURITY INVOKER
BEGIN
    DECLARE gone INT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    SELECT 1 INTO @tower_lock_found FROM tower_lock WHERE name = p_name FOR UPDATE;
    DELETE FROM tower_lock_holders WHERE name = p_name AND holder = p_holder AND kind = 'w';
    SET gone = ROW_COUNT();
    IF gone > 0 THEN
        UPDATE tower_lock SET writers = (SELECT COUNT(*) FROM tower_lock_holders
            WHERE name = p_name AND kind = 'w') WHERE name = p_name;
    END IF;
    COMMIT;
    IF gone > 0 AND p_wake THEN
        CALL tower_lock_wake(p_channel);
    END IF;
END //

-- Stores the idempotency record p_record for `p_name`, kept for p_retention_ms, if the hold
-- with the fencing token p_token still holds the name's lock, and replaces the name's
-- record, expired or not. The hold holds it while the lock is held, unexpired, under
-- p_token or a token below it: a hold passed between tasks of one process in memory keeps
-- the row's token, below the tokens of the tasks it was passed to, and any other hold
-- since (here or elsewhere) got a token above every token issued before it, p_token
-- included. Replies 1 when stored, 0 when not.
DROP PROCEDURE IF EXISTS tower_lock_record_store //
CREATE PROCEDURE tower_lock_record_store(p_name VARBINARY(2800), p_token BIGINT,
    p_retention_ms BIGINT, p_record LONGBLOB)
SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE held INT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    START TRANSACTION;
    -- A locking read: the row as the last release or force-release committed it.
    SELECT COUNT(*) INTO held FROM tower_lock
    WHERE name = p_name AND owner IS NOT NULL AND expires > t_now AND token <= p_token
    FOR UPDATE;
    IF held > 0 THEN
        INSERT INTO tower_lock_records (name, record, expires)
        VALUES (p_name, p_record, t_now + INTERVAL p_retention_ms * 1000 MICROSECOND)
        ON DUPLICATE KEY UPDATE record = VALUES(record), expires = VALUES(expires);
    END IF;
    COMMIT;
    SELECT IF(held > 0, '1', '0');
END //

-- Deletes up to p_limit names that nobody holds, waits for or used within the last
-- p_keep_ms (their fencing counters are no longer needed: a new token is never below the
-- clock in microseconds), with their expired holders, and the waiter rows of wake
-- connections that are gone (a process killed without closing), and up to p_limit
-- expired records (in a statement of their own, after the names' transaction). Replies how
-- many names went, or how many records if more (p_limit: there may be more left).
DROP PROCEDURE IF EXISTS tower_lock_sweep //
CREATE PROCEDURE tower_lock_sweep(p_keep_ms BIGINT, p_limit INT) SQL SECURITY INVOKER
BEGIN
    DECLARE t_now DATETIME(6) DEFAULT UTC_TIMESTAMP(6);
    DECLARE gone, records_gone INT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;
    DELETE FROM tower_lock_waiters
    WHERE conn NOT IN (SELECT ID FROM information_schema.PROCESSLIST);
    START TRANSACTION;
    DELETE h FROM tower_lock_holders h JOIN (SELECT l.name FROM tower_lock l
            WHERE l.touched < t_now - INTERVAL p_keep_ms * 1000 MICROSECOND
                AND (l.owner IS NULL OR l.expires <= t_now)
                AND NOT EXISTS (SELECT 1 FROM tower_lock_holders x
                    WHERE x.name = l.name AND x.expires > t_now)
            ORDER BY l.touched LIMIT p_limit) d ON h.name = d.name;
    DELETE FROM tower_lock
    WHERE touched < t_now - INTERVAL p_keep_ms * 1000 MICROSECOND
        AND (owner IS NULL OR expires <= t_now)
        AND NOT EXISTS (SELECT 1 FROM tower_lock_holders h
            WHERE h.name = tower_lock.name AND h.expires > t_now)
    ORDER BY touched LIMIT p_limit;
    SET gone = ROW_COUNT();
    COMMIT;
    DELETE FROM tower_lock_records WHERE expires <= t_now ORDER BY expires LIMIT p_limit;
    SET records_gone = ROW_COUNT();
    SELECT GREATEST(gone, records_gone);
END //

-- Last: an instance that builds while another migrates sees this version only once every
-- table and procedure above is there (it skips migrating when the version is current).
DROP PROCEDURE IF EXISTS tower_lock_schema_version //
CREATE PROCEDURE tower_lock_schema_version() SQL SECURITY INVOKER
SELECT 2 //

DELIMITER ;
